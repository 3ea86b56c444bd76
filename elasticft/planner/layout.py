"""The parallelism planner: a legal TP×PP×DP for the GPUs that are alive.

Pure functions, no I/O, deterministic. ``plan`` takes the model and batch facts, the
GPU count of every live node (in rank order) and the operator's policy, and returns
the layout eft-run restarts Megatron with, plus the ranks left spare. The rules are
Megatron's (megatron-core 0.16 and Megatron-LM's argument checks); docs/planner.md
lists them with the choice order and the cost model (``elasticft.planner.cost``).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

from elasticft.planner import cost as layout_cost
from elasticft.planner.facts import BatchFacts, ModelFacts, Policy, with_limits

__all__ = ["BatchFacts", "Layout", "ModelFacts", "NoLegalLayout", "Plan", "Policy", "divisors",
           "explain_no_layout", "legal_layouts", "plan", "plan_env", "select_gpus", "with_limits"]


class NoLegalLayout(ValueError):
    """No TP×PP×DP meets Megatron's rules on the given GPUs or on any fewer of them."""


@dataclass(frozen=True)
class Layout:
    """One legal TP×PP×DP with its estimated cost."""

    tp: int
    pp: int
    dp: int
    vp: int | None  # model chunks per pipeline rank under the interleaved schedule
    microbatches: int  # per DP replica per global batch
    step_seconds: float  # estimated, nominal hardware (layout_cost)
    bubble: float  # fraction of the step the pipeline idles
    memory_gb: float | None  # estimated peak per GPU; None when sizes are unknown

    @property
    def used(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Plan:
    tp: int
    pp: int
    dp: int
    vp: int | None
    used: int
    world: int  # GPUs offered
    spare: list[int]  # global ranks, numbered node by node in input order
    spare_nodes: list[int]  # indices of nodes that run no worker at all
    used_per_node: list[int]  # workers per node: each node runs its first N local ranks
    reason: str
    layouts: list[Layout] | None = field(default=None)  # every legal layout, best first

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.layouts is None:
            del out["layouts"]
        return out


def plan_env(chosen: Plan) -> dict[str, str]:
    """The environment eft-run gives each worker so that scripts can read the layout."""
    return {"EFT_TP": str(chosen.tp), "EFT_PP": str(chosen.pp), "EFT_DP": str(chosen.dp)}


def divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


# Legality checks. Each returns None when the value passes, else the constraint's text;
# the texts double as keys that group failures in NoLegalLayout's message.

def tp_problem(tp: int, model: ModelFacts, policy: Policy) -> str | None:
    if policy.fixed_tp and tp != policy.fixed_tp:
        return f"is not the checkpoint's TP {policy.fixed_tp} (its format reshards DP only)"
    if policy.max_tp_per_node and tp > policy.max_tp_per_node:
        return f"exceeds max_tp_per_node {policy.max_tp_per_node}"
    if model.num_attention_heads % tp:
        return f"does not divide num_attention_heads {model.num_attention_heads}"
    groups = model.num_query_groups
    if groups % tp and tp % groups:
        return f"neither divides nor is a multiple of num_query_groups {groups}"
    return None


def pipeline_problem(pp: int, model: ModelFacts, policy: Policy) -> str | None:
    if policy.fixed_pp and pp != policy.fixed_pp:
        return f"is not the checkpoint's PP {policy.fixed_pp} (its format reshards DP only)"
    layers = model.num_layers
    if policy.interleaved and pp < 2:
        return "is too small: the interleaved schedule needs PP > 1"
    first = policy.decoder_first_pipeline_num_layers
    last = policy.decoder_last_pipeline_num_layers
    named = [n for n in (first, last) if n]
    if not named:
        if layers % pp:
            return f"does not divide num_layers {layers}"
        per_rank = layers // pp
    else:
        middle_stages, middle_layers = pp - len(named), layers - sum(named)
        if middle_layers < 0:
            return f"is impossible: first/last stages hold {sum(named)} of {layers} layers"
        if middle_stages < 0 or (middle_stages == 0) != (middle_layers == 0):
            return f"leaves {middle_layers} middle layers for {max(middle_stages, 0)} " \
                   "middle stages (uneven first/last stages)"
        if middle_stages and middle_layers % middle_stages:
            return f"does not divide the {middle_layers} middle layers evenly " \
                   "(uneven first/last stages)"
        per_rank = middle_layers // middle_stages if middle_stages else 0
    if policy.layers_per_virtual_stage and per_rank % policy.layers_per_virtual_stage:
        return (f"gives {per_rank} layers per rank, not a multiple of "
                f"num_layers_per_virtual_pipeline_stage {policy.layers_per_virtual_stage}")
    stages = policy.virtual_stages_per_rank
    if stages and (per_rank % stages or any(n % stages for n in named)):
        return (f"gives stages whose layer counts are not multiples of "
                f"num_virtual_stages_per_pipeline_rank {stages}")
    return None


def batch_problem(dp: int, batch: BatchFacts, policy: Policy) -> str | None:
    if batch.global_batch_size % (batch.micro_batch_size * dp):
        return (f"leaves micro_batch_size {batch.micro_batch_size} × DP not dividing "
                f"global_batch_size {batch.global_batch_size}")
    if dp < policy.min_dp:
        return f"is below min_dp {policy.min_dp}"
    return None


def schedule_problem(pp: int, microbatches: int, policy: Policy) -> str | None:
    # megatron-core's interleaved schedule groups microbatches PP at a time and
    # rejects a final partial group (schedules.py): microbatches % PP == 0.
    if policy.interleaved and microbatches % pp:
        return "leaves microbatches per replica not a multiple of PP (interleaved schedule)"
    return None


def _stage_layers(pp: int, model: ModelFacts, policy: Policy) -> int:
    """Layers on the pipeline's largest stage (the layout is assumed legal)."""
    named = [n for n in (policy.decoder_first_pipeline_num_layers,
                         policy.decoder_last_pipeline_num_layers) if n]
    middle_stages = pp - len(named)
    middle = (model.num_layers - sum(named)) // middle_stages if middle_stages else 0
    return max(named + [middle])


def _virtual_size(pp: int, model: ModelFacts, policy: Policy) -> int | None:
    if policy.layers_per_virtual_stage:
        return model.num_layers // pp // policy.layers_per_virtual_stage
    return policy.virtual_stages_per_rank


def evaluate(tp: int, pp: int, dp: int, model: ModelFacts, batch: BatchFacts,
             policy: Policy) -> tuple[Layout | None, str | None]:
    """The layout with its cost, or (None, why) when the schedule or memory rule fails.

    TP, PP and DP must already pass their own checks.
    """
    microbatches = batch.global_batch_size // (batch.micro_batch_size * dp)
    problem = schedule_problem(pp, microbatches, policy)
    if problem:
        return None, problem
    stage_layers = _stage_layers(pp, model, policy)
    vp = _virtual_size(pp, model, policy)
    memory = layout_cost.memory_gb(model, batch, tp, pp, stage_layers, vp, microbatches)
    if policy.memory_per_gpu_gb is not None and memory is not None \
            and memory > policy.memory_per_gpu_gb:
        return None, f"needs about {memory:.0f} GB per GPU, over memory_per_gpu_gb " \
                     f"{policy.memory_per_gpu_gb:g}"
    seconds, bubble = layout_cost.step_seconds(model, batch, tp, pp, dp, stage_layers, vp,
                                               microbatches)
    return Layout(tp, pp, dp, vp, microbatches, seconds, bubble, memory), None


def select_gpus(nodes: Sequence[int], tp: int, used: int) -> list[int]:
    """GPUs each node contributes when ``used`` GPUs run with tensor parallel size ``tp``.

    A TP group never spans nodes, so a node gives a multiple of TP. Spare GPUs come
    first from whole nodes, smallest first (the later node on ties), then from the end
    of the node with the most (the later node on ties).
    """
    counts = [n - n % tp for n in nodes]
    spare = sum(counts) - used
    for i in sorted(range(len(counts)), key=lambda i: (counts[i], -i)):
        if counts[i] > spare:
            break
        spare -= counts[i]
        counts[i] = 0
    if spare:
        fullest = max(range(len(counts)), key=lambda i: (counts[i], i))
        counts[fullest] -= spare
    return counts


def describe_nodes(nodes: Sequence[int]) -> str:
    if len(nodes) <= 8:
        return "nodes " + ",".join(map(str, nodes))
    sizes = sorted(Counter(nodes).items(), reverse=True)
    if len(sizes) == 1:
        return f"{len(nodes)} nodes of {sizes[0][0]} GPUs"
    return f"{len(nodes)} nodes: " + ", ".join(f"{count}×{size}" for size, count in sizes) + " GPUs"


def explain_no_layout(nodes: Sequence[int], model: ModelFacts, batch: BatchFacts,
                      policy: Policy) -> str:
    """One line: which constraint rejected each TP×PP×DP of the whole world size."""
    world = sum(nodes)
    sizes = sorted({n for n in nodes if n})
    failures: dict[str, list[str]] = {}
    total = 0
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // tp // pp
            total += 1
            label, problem = f"TP={tp}", tp_problem(tp, model, policy)
            if problem is None and any(size % tp for size in sizes):
                problem = "does not divide every node's GPU count (a TP group would span nodes)"
            if problem is None:
                label, problem = f"PP={pp}", pipeline_problem(pp, model, policy)
            if problem is None:
                label, problem = f"DP={dp}", batch_problem(dp, batch, policy)
            if problem is None:
                label, problem = f"TP={tp},PP={pp},DP={dp}", \
                    evaluate(tp, pp, dp, model, batch, policy)[1]
            labels = failures.setdefault(problem or "is legal", [])
            if label not in labels:
                labels.append(label)
    parts = []
    for problem, labels in failures.items():
        more = f" and {len(labels) - 6} more" if len(labels) > 6 else ""
        name = labels[0].split("=")[0] + "="
        if all(label.startswith(name) and "," not in label for label in labels):
            shown = name + ",".join(label[len(name):] for label in labels[:6])  # PP=1,2,4
        else:
            shown = ", ".join(labels[:6])
        parts.append(f"{shown}{more} {problem}")
    gpus = f"{world} GPU" + ("s" if world != 1 else "")
    return (f"no legal layout for {gpus} ({describe_nodes(nodes)}) or any fewer; "
            f"the {total} TP×PP×DP splits of {world}: " + "; ".join(parts))


def legal_layouts(nodes: Sequence[int], model: ModelFacts, batch: BatchFacts,
                  policy: Policy) -> list[Layout]:
    """Every legal layout on the largest GPU count that has one (empty if none)."""
    sizes = Counter(n for n in nodes if n)
    largest = max(sizes, default=0)
    # capacity[tp]: TP groups the cluster holds when no group may span two nodes
    capacity = {tp: sum(count * (size // tp) for size, count in sizes.items())
                for tp in divisors(model.num_attention_heads)
                if tp <= largest and tp_problem(tp, model, policy) is None}
    pps = [pp for pp in range(1, min(model.num_layers, sum(nodes)) + 1)
           if pipeline_problem(pp, model, policy) is None]
    dps = []
    if batch.global_batch_size % batch.micro_batch_size == 0:
        dps = [dp for dp in divisors(batch.global_batch_size // batch.micro_batch_size)
               if batch_problem(dp, batch, policy) is None]
    best = 0
    for tp, groups in capacity.items():
        for pp in pps:
            if pp > groups:
                break
            # largest DP first; stop once it cannot beat the best GPU count found
            for dp in reversed(dps[:bisect.bisect_right(dps, groups // pp)]):
                if tp * pp * dp <= best:
                    break
                if evaluate(tp, pp, dp, model, batch, policy)[0] is not None:
                    best = tp * pp * dp
                    break
    layouts = []
    for tp, groups in capacity.items():
        for pp in pps:
            dp, rest = divmod(best, tp * pp)
            if best and not rest and pp * dp <= groups and dp in dps:
                layout = evaluate(tp, pp, dp, model, batch, policy)[0]
                if layout is not None:
                    layouts.append(layout)
    return layouts


def plan(model: ModelFacts, batch: BatchFacts, nodes: Sequence[int],
         policy: Policy = Policy(), *, with_layouts: bool = False) -> Plan:
    """Choose the layout for ``nodes`` (GPUs per live node, in rank order).

    Order of choice: the most GPUs; then the previous TP (``policy.preferred_tp``); then
    the lowest estimated step time; then the smaller TP, then the smaller PP.
    Raises NoLegalLayout, whose message names the failing constraints, when even one
    GPU has no legal layout, and ValueError on malformed input.
    """
    nodes = list(nodes)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
        raise ValueError(f"GPUs per node must be integers >= 0, got {nodes}")
    world = sum(nodes)
    if world == 0:
        raise ValueError("no GPUs to plan for")
    if policy.memory_per_gpu_gb is not None and (model.hidden_size is None
                                                 or model.seq_length is None):
        raise ValueError("memory_per_gpu_gb needs the model's hidden_size and seq_length")
    layouts = legal_layouts(nodes, model, batch, policy)
    if not layouts:
        raise NoLegalLayout(explain_no_layout(nodes, model, batch, policy))
    keep = policy.preferred_tp
    layouts.sort(key=lambda lay: (lay.tp != keep, lay.step_seconds, lay.tp, lay.pp))
    best = layouts[0]
    counts = select_gpus(nodes, best.tp, best.used)
    spare, start = [], 0
    for size, count in zip(nodes, counts):
        spare.extend(range(start + count, start + size))
        start += size
    spare_nodes = [i for i, count in enumerate(counts) if count == 0]
    used_text = f"all {world} GPUs used" if best.used == world else \
        f"{best.used} of {world} GPUs used (no legal layout uses more)"
    if keep is None:
        tp_text = ""
    elif best.tp == keep:
        tp_text = f"; TP={keep} kept from the previous layout"
    else:
        tp_text = f"; previous TP={keep} has no legal layout on {best.used} GPUs"
    rivals = sum(1 for lay in layouts if (lay.tp == keep) == (best.tp == keep))
    reason = (f"{used_text}{tp_text}; lowest estimated step time "
              f"({best.step_seconds:.2f} s nominal) of {rivals} candidate layout"
              + ("s" if rivals != 1 else ""))
    return Plan(best.tp, best.pp, best.dp, best.vp, best.used, world, spare, spare_nodes,
                counts, reason, layouts if with_layouts else None)
