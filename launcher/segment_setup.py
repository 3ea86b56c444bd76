"""``--eft-segment N``: this node's domain, and a job size in whole segments, settled at launch.

The domain is ``--eft-segment-domain`` or, without it, the NVLink domain NVML's GPU fabric
information names (``health/fabric.py``). A node with none, or ``--nnodes`` bounds that are not
whole segments, is a mistake said in one line before anything starts: such a node could never
be taken into a round.
"""

from __future__ import annotations

import dataclasses
import logging

from elasticft.config import ConfigError, Settings, flag_name
from elasticft.contract.keys import BACKEND_NAME
from elasticft.health.fabric import nvlink_domain

log = logging.getLogger(__name__)


def resolve_segments(args, settings: Settings) -> Settings:
    """``settings`` with this node's segment domain filled in; raises ConfigError on a mistake.
    ``args``: eft-run's, --nnodes checked already (N or MIN:MAX)."""
    config = settings.segments
    if not config.segment:
        return settings
    per, nnodes = config.segment, args.nnodes
    if args.rdzv_backend != BACKEND_NAME and not args.standalone:
        raise ConfigError(f"{flag_name('segment')} {per}: segments need --rdzv-backend {BACKEND_NAME}, "
                          f"got {args.rdzv_backend}")
    bounds = [int(n) for n in nnodes.split(":")]
    if any(n % per for n in bounds):
        raise ConfigError(f"{flag_name('segment')} {per}: --nnodes {nnodes} must be whole segments "
                          f"(multiples of {per})")
    domain = config.segment_domain or nvlink_domain()
    if not domain:
        raise ConfigError(f"{flag_name('segment')} {per}: this node's GPUs report no NVLink domain (no fabric "
                          f"information from NVML); name its domain with {flag_name('segment_domain')}")
    log.info("segments of %d node(s): this node's domain is %s%s", per, domain,
             "" if config.segment_domain else " (from NVML's GPU fabric information)")
    return dataclasses.replace(settings, segments=dataclasses.replace(config, segment_domain=domain))
