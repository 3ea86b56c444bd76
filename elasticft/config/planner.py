"""``PlannerConfig``: the operator's limits on the layouts the parallelism planner may choose."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class PlannerConfig:
    """The operator's limits on the layouts the parallelism planner may choose."""

    max_tp_per_node: int = knob(0, "largest tensor-parallel size to use (0: up to a node's GPU count)")
    memory_per_gpu_gb: float = knob(
        0.0,
        "GPU memory per GPU in GB (10^9 bytes); layouts estimated to need more are "
        "rejected (0: no memory check)",
    )
    min_dp: int = knob(1, "smallest data-parallel size a layout may have")
    model_config: str = knob(
        "",
        "JSON file of model facts (num_layers, num_attention_heads, ...) for the planner; "
        "default: read them from the worker's Megatron arguments",
    )

    def __post_init__(self) -> None:
        if self.max_tp_per_node < 0:
            raise ConfigError(f"{flag_name('max_tp_per_node')}: expected >= 0, got {self.max_tp_per_node}")
        if self.memory_per_gpu_gb < 0:
            raise ConfigError(f"{flag_name('memory_per_gpu_gb')}: expected >= 0, got {self.memory_per_gpu_gb}")
        if self.min_dp < 1:
            raise ConfigError(f"{flag_name('min_dp')}: expected >= 1, got {self.min_dp}")
