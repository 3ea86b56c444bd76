"""GPU health: telemetry sources, the per-GPU risk model, and the sampler thread."""

from elasticft.health.nvml import NvmlSource, NvmlUnavailable
from elasticft.health.publish import EtcdHealthPublisher, health_record
from elasticft.health.risk import CRITICAL_XIDS, FACTORS, RiskModel, RiskScore
from elasticft.health.sample import DiskSpace, GpuSample, HostSample
from elasticft.health.sampler import HealthSampler, make_source
from elasticft.health.sources import HostSource, ReplaySource, Source
from elasticft.health.summary import GpuSummary, summarize
from elasticft.health.trace import TraceError, read_trace, write_trace

__all__ = [
    "CRITICAL_XIDS",
    "DiskSpace",
    "EtcdHealthPublisher",
    "FACTORS",
    "GpuSample",
    "GpuSummary",
    "HealthSampler",
    "HostSample",
    "HostSource",
    "NvmlSource",
    "NvmlUnavailable",
    "ReplaySource",
    "RiskModel",
    "RiskScore",
    "Source",
    "TraceError",
    "health_record",
    "make_source",
    "read_trace",
    "summarize",
    "write_trace",
]
