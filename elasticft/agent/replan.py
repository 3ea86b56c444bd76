"""Re-planning at every rendezvous: a legal TP x PP x DP for the GPUs that are there.

The agent asks ``RoundPlanner`` for a plan once per rendezvous round. Every agent
puts its GPU count in the round's c10d store; the round's rank 0 reads them all (one
batched read) and puts the list back as one short key (runs of equal counts: a few bytes
for a homogeneous job of any size), which every other agent reads. So all of them feed the
same inputs to the (deterministic) planner and agree, and a round costs the store N puts,
N reads and one batch, not N reads by each of N agents. The plan
decides which local workers run (spare ranks sit out), their global ranks, the
rewritten ``--tensor-model-parallel-size``/``--pipeline-model-parallel-size`` and
``EFT_TP``/``EFT_PP``/``EFT_DP``.

Planning is on when the worker command carries Megatron's model arguments
(``--num-layers``, ``--num-attention-heads``) or ``--eft-model-config`` is given;
otherwise the agent assigns ranks exactly as torchrun does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from elasticft.config import PlannerConfig
from elasticft.planner.facts import with_limits
from elasticft.planner.layout import NoLegalLayout, Plan, plan, plan_env
from elasticft.planner.megatron_args import (
    MegatronFacts,
    load_model_config,
    model_facts_from_argv,
    reshard_rule,
    rewrite_megatron_args,
)

log = logging.getLogger(__name__)

_GPUS_KEY = "eft/local_world_size/"
_COUNTS_KEY = "eft/local_world_sizes"  # every node's count, in order, as runs: "8*1023,4"
_MODEL_FLAGS = ("--num-layers", "--num-attention-heads")


@dataclass(frozen=True)
class RankAssignment:
    """This node's share of a plan: how many local workers run and their first global rank."""

    plan: Plan
    local_workers: int
    first_rank: int


class RoundPlanner:
    def __init__(self, facts: MegatronFacts, limits: PlannerConfig, worker_args: tuple, rewrite_args: bool = True):
        self._facts = facts
        # False for a Megatron-Bridge job: its recipe takes TP and PP from EFT_TP/EFT_PP
        # (megatron_bridge/recipe.py), and Megatron-LM flags appended to its command would be
        # read as its own arguments.
        self._rewrite_args = rewrite_args
        self._policy = with_limits(facts.policy, limits)
        self._worker_args = tuple(worker_args)
        self.previous_tp = facts.tp
        self.current: Plan | None = None

    @classmethod
    def for_worker(cls, worker_args: tuple, limits: PlannerConfig, bridge: bool = False) -> "RoundPlanner | None":
        """A planner if the job describes a Megatron model, else None (torchrun's ranks).
        ``bridge``: a Megatron-Bridge job, whose model only ``--eft-model-config`` describes."""
        if limits.model_config:
            return cls(load_model_config(limits.model_config), limits, worker_args, rewrite_args=not bridge)
        if bridge:
            return None
        argv = [str(a) for a in worker_args]
        if not any(a.split("=", 1)[0] in _MODEL_FLAGS for a in argv):
            return None
        log.info("checkpoints: %s", reshard_rule(argv)[1])
        return cls(model_facts_from_argv(argv), limits, worker_args)

    def assign(self, store, group_rank: int, group_world_size: int, local_world_size: int) -> RankAssignment:
        """Share GPU counts through the round's store, plan, and place this node.

        Raises NoLegalLayout when no layout fits (the agent must then exit, not loop).
        """
        store.set(f"{_GPUS_KEY}{group_rank}", str(local_world_size))
        if group_rank == 0:
            nodes = [int(c) for c in store.multi_get([f"{_GPUS_KEY}{i}" for i in range(group_world_size)])]
            store.set(_COUNTS_KEY, encode_counts(nodes))
        else:
            nodes = decode_counts(store.get(_COUNTS_KEY))
        if len(nodes) != group_world_size:
            raise RuntimeError(f"the round's GPU counts name {len(nodes)} nodes, not {group_world_size}")
        policy = replace(self._policy, preferred_tp=self.previous_tp or None)
        chosen = plan(self._facts.model, self._facts.batch, nodes, policy)
        self.previous_tp = chosen.tp
        self.current = chosen
        first = sum(chosen.used_per_node[:group_rank])
        return RankAssignment(chosen, chosen.used_per_node[group_rank], first)

    def worker_args(self) -> tuple:
        if not self._rewrite_args:
            return self._worker_args
        return tuple(rewrite_megatron_args([str(a) for a in self._worker_args], self.current))

    def worker_env(self) -> dict[str, str]:
        return plan_env(self.current)


def encode_counts(counts: list[int]) -> str:
    """``[8, 8, 8, 4]`` as ``"8*3,4"``: each run of equal counts once."""
    runs: list[list[int]] = []
    for count in counts:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    return ",".join(f"{count}*{times}" if times > 1 else str(count) for count, times in runs)


def decode_counts(raw: bytes | str) -> list[int]:
    """The list ``encode_counts`` wrote."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    counts: list[int] = []
    for run in filter(None, text.split(",")):
        count, _, times = run.partition("*")
        counts += [int(count)] * int(times or 1)
    return counts


__all__ = ["NoLegalLayout", "RankAssignment", "RoundPlanner", "decode_counts", "encode_counts"]
