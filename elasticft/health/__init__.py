"""GPU health: telemetry sources, the per-GPU risk model, and the sampler thread."""

from .nvml import NvmlSource, NvmlUnavailable
from .publish import EtcdHealthPublisher, health_record
from .risk import CRITICAL_XIDS, FACTORS, RiskModel, RiskScore
from .sample import DiskSpace, GpuSample, HostSample
from .sampler import HealthSampler, make_source
from .sources import HostSource, ReplaySource, Source
from .summary import GpuSummary, summarize
from .trace import TraceError, read_trace, write_trace

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
