"""eft-run in a JobSet pod: derive what the pod's variables say (elasticft/kubernetes/), print
it once, and give back the settings with the pod's name as the node id."""

from __future__ import annotations

import dataclasses
import os
import sys

from elasticft.config import Settings
from elasticft.config.knobs import ConfigError
from elasticft.kubernetes.defaults import derive
from elasticft.kubernetes.pod import JobSetPod


def apply_jobset(args, settings: Settings) -> Settings:
    """In a JobSet pod (and ``--eft-kubernetes``): set the flags left at torchrun's defaults
    from the pod; the settings, with the node id the pod's name where none was given."""
    if not settings.ft.kubernetes:
        return settings
    try:
        pod = JobSetPod.from_environ(os.environ)
    except ValueError as exc:  # a pod spec's mistake: its downward API names no count
        raise ConfigError(str(exc)) from None
    if pod is None:
        return settings
    derived = derive(args, pod, node_id_set=bool(settings.ft.node_id))
    print(f"eft-run: {derived.describe(pod)}", file=sys.stderr, flush=True)
    if not derived.node_id:
        return settings
    return dataclasses.replace(settings, ft=dataclasses.replace(settings.ft, node_id=derived.node_id))
