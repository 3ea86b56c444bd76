"""The health sampler: a thread in the node agent that reads a source every
``interval`` seconds, scores the samples, publishes them, and calls back when a GPU
crosses the risk threshold (once per crossing: it must fall below and rise again to
call back again).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from elasticft.config import ConfigError, flag_name
from elasticft.health.nvml import NvmlSource, NvmlUnavailable
from elasticft.health.risk import RiskModel, RiskScore
from elasticft.health.sample import GpuSample, HostSample
from elasticft.health.sources import HostSource, ReplaySource, Source
from elasticft.health.trace import TraceError
from elasticft.periodic import PeriodicTask

log = logging.getLogger(__name__)

Publish = Callable[[list[tuple[GpuSample, RiskScore]]], None]
OnTrigger = Callable[[RiskScore], None]
_FROM_ENV = object()


class HealthSampler(PeriodicTask):
    """Samples ``source`` on a daemon thread between ``start()`` and ``stop()``.

    ``publish(records)`` gets each GPU's latest (sample, score) after every read;
    ``on_trigger(score)`` runs on the sampler thread for each crossing, before
    publishing, so keep it short (e.g. post the checkpoint request). Failures of
    the source, ``publish`` or ``on_trigger`` are logged and sampling goes on.
    """

    name = "eft-health"

    def __init__(
        self,
        source: Source,
        model: RiskModel,
        interval: float = 10.0,
        publish: Publish | None = None,
        on_trigger: OnTrigger | None = None,
        host_source: HostSource | None = None,
    ):
        if not interval > 0:
            raise ValueError(f"sampling interval must be positive, got {interval}")
        self.source = source
        self.model = model
        self.interval = interval
        self.publish = publish
        self.on_trigger = on_trigger
        self.host_source = host_source
        self.latest: dict[tuple[str, int], tuple[GpuSample, RiskScore]] = {}
        self.latest_host: HostSample | None = None
        self._last_error: str | None = None

    def _warn(self, what: str, exc: BaseException) -> None:
        message = f"{what}: {exc}"
        if message != self._last_error:  # one line per new problem, not one per sample
            log.warning("health sampler: %s", message)
            self._last_error = message

    def check_once(self) -> list[RiskScore]:
        return self.sample_once()

    def sample_once(self) -> list[RiskScore]:
        """Read, score, call back and publish once; returns this read's scores."""
        if self.host_source is not None:
            try:
                self.latest_host = self.host_source.read()
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop GPU sampling
                self._warn("reading host metrics failed", exc)
        try:
            samples = self.source.read()
        except Exception as exc:  # noqa: BLE001 - the source may be a driver in trouble
            self._warn("reading the health source failed", exc)
            return []
        scores = self.model.update(samples)
        latest = dict(self.latest)
        fresh: dict[tuple[str, int], tuple[GpuSample, RiskScore]] = {}
        for sample, score in zip(samples, scores):
            latest[sample.key] = fresh[sample.key] = (sample, score)
        self.latest = latest
        for score in scores:
            if score.crossed and self.on_trigger is not None:
                log.warning(
                    "GPU %d on %s crossed the risk threshold: %.2f (%s)",
                    score.gpu, score.node, score.score, score.critical or score.dominant,
                )
                try:
                    self.on_trigger(score)
                except Exception:  # noqa: BLE001
                    log.exception("health sampler: the trigger callback failed")
        if fresh and self.publish is not None:
            try:
                self.publish(list(fresh.values()))
            except Exception as exc:  # noqa: BLE001 - etcd down must not stop sampling
                self._warn("publishing health records failed", exc)
        return scores


def make_source(
    spec: str,
    node_id: str,
    visible_devices: Any = _FROM_ENV,
    nvml: Any = None,
) -> Source | None:
    """The source that ``--eft-health-source`` names, or None for no sampling.

    ``""`` (auto) is NVML when it loads, else None with one log line; ``nvml``
    insists on NVML; ``replay:PATH`` plays a trace in real time; ``none`` is None.
    """
    flag = flag_name("health_source")
    spec = spec.strip()
    kwargs = {} if visible_devices is _FROM_ENV else {"visible_devices": visible_devices}
    if spec == "none":
        return None
    if spec in ("", "nvml"):
        try:
            source = NvmlSource(node_id, nvml=nvml, **kwargs)
        except NvmlUnavailable as exc:
            if spec == "nvml":
                raise ConfigError(f"{flag} nvml: {exc}") from None
            log.info("GPU health sampling is off: %s (%s chooses a source)", exc, flag)
            return None
        if spec == "" and not source.gpus:  # e.g. CUDA_VISIBLE_DEVICES="" on a GPU host
            source.close()
            log.info("GPU health sampling is off: CUDA_VISIBLE_DEVICES shows no GPU (%s chooses a source)", flag)
            return None
        return source
    if spec.startswith("replay:"):
        path = spec[len("replay:"):]
        if not path:
            raise ConfigError(f"{flag}: replay needs a trace, as in replay:/path/trace.csv")
        if not Path(path).is_file():
            raise ConfigError(f"{flag}: trace {path} is not a file")
        try:
            return ReplaySource(path, node=node_id, speed=1.0)
        except TraceError as exc:
            raise ConfigError(f"{flag}: {exc}") from None
    raise ConfigError(f"{flag}: expected nvml, replay:PATH, none or empty (auto), got {spec!r}")
