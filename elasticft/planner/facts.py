"""The planner's inputs: what it knows about the model and the batch, and the policy.

Plain validated dataclasses; ``elasticft.planner.layout`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from elasticft.config import PlannerConfig


def _check_positive(owner: object, names: Sequence[str], optional: bool) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelFacts:
    """What the planner must know about the model; sizes only feed the cost model."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # None: one group per head (no GQA)
    hidden_size: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    params: int | None = None  # total parameters when known; else estimated

    def __post_init__(self) -> None:
        _check_positive(self, ("num_layers", "num_attention_heads"), optional=False)
        _check_positive(self, ("num_query_groups", "hidden_size", "seq_length", "vocab_size",
                               "params"), optional=True)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple "
                             f"of num_query_groups {self.num_query_groups}")


@dataclass(frozen=True)
class BatchFacts:
    global_batch_size: int
    micro_batch_size: int

    def __post_init__(self) -> None:
        _check_positive(self, ("global_batch_size", "micro_batch_size"), optional=False)


@dataclass(frozen=True)
class Policy:
    """The operator's limits and the training's pipeline split (Megatron's names)."""

    preferred_tp: int | None = None  # the running TP: keeping it avoids a TP reshard
    max_tp_per_node: int | None = None
    memory_per_gpu_gb: float | None = None  # None: no memory check
    min_dp: int = 1
    layers_per_virtual_stage: int | None = None  # --num-layers-per-virtual-pipeline-stage
    virtual_stages_per_rank: int | None = None  # --num-virtual-stages-per-pipeline-rank
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    # The checkpoint format reshards DP only (megatron_args.reshard_rule): TP and PP stay these.
    fixed_tp: int | None = None
    fixed_pp: int | None = None

    def __post_init__(self) -> None:
        _check_positive(self, ("preferred_tp", "max_tp_per_node", "layers_per_virtual_stage", "fixed_tp", "fixed_pp",
                               "virtual_stages_per_rank", "decoder_first_pipeline_num_layers",
                               "decoder_last_pipeline_num_layers"), optional=True)
        _check_positive(self, ("min_dp",), optional=False)
        if self.memory_per_gpu_gb is not None and not self.memory_per_gpu_gb > 0:
            raise ValueError(f"memory_per_gpu_gb: expected > 0, got {self.memory_per_gpu_gb!r}")
        if self.layers_per_virtual_stage and self.virtual_stages_per_rank:
            raise ValueError("num_layers_per_virtual_pipeline_stage and "
                             "num_virtual_stages_per_pipeline_rank cannot both be set")
        uneven = self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers
        if uneven and self.layers_per_virtual_stage:
            raise ValueError("uneven first/last pipeline stages need "
                             "num_virtual_stages_per_pipeline_rank, not "
                             "num_layers_per_virtual_pipeline_stage (Megatron's rule)")

    @property
    def interleaved(self) -> bool:
        return bool(self.layers_per_virtual_stage or self.virtual_stages_per_rank)


def with_limits(policy: Policy, limits: PlannerConfig) -> Policy:
    """``policy`` with the operator's knobs (a 0 in PlannerConfig means no limit)."""
    return replace(policy, max_tp_per_node=limits.max_tp_per_node or None,
                   memory_per_gpu_gb=limits.memory_per_gpu_gb or None, min_dp=limits.min_dp)
