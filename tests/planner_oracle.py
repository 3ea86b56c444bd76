"""An oracle for the planner's tests, independent of the planner's code.

``megatron_accepts`` restates Megatron's rules for a layout; ``brute_force`` tries every
way of taking GPUs from the nodes; ``cases`` draws models, batches and pipeline splits.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hypothesis import strategies as st

from elasticft.planner.layout import BatchFacts, ModelFacts, Policy


@dataclass(frozen=True)
class Case:
    layers: int
    heads: int
    groups: int
    gbs: int
    mbs: int
    min_dp: int = 1
    max_tp: int | None = None
    vp_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage
    vp_stages: int | None = None  # --num-virtual-stages-per-pipeline-rank
    first: int | None = None
    last: int | None = None

    def inputs(self, preferred_tp=None):
        model = ModelFacts(self.layers, self.heads, self.groups)
        policy = Policy(preferred_tp=preferred_tp, max_tp_per_node=self.max_tp, min_dp=self.min_dp,
                        layers_per_virtual_stage=self.vp_layers,
                        virtual_stages_per_rank=self.vp_stages,
                        decoder_first_pipeline_num_layers=self.first,
                        decoder_last_pipeline_num_layers=self.last)
        return model, BatchFacts(self.gbs, self.mbs), policy


def megatron_accepts(tp, pp, dp, used_per_node, c: Case) -> bool:
    """Megatron's rules, restated independently of the planner."""
    if tp * pp * dp != sum(used_per_node):
        return False
    if c.heads % tp or (c.groups % tp and tp % c.groups):
        return False
    if (c.max_tp and tp > c.max_tp) or any(n % tp for n in used_per_node):
        return False  # a TP group must sit inside one node
    interleaved = c.vp_layers or c.vp_stages
    if interleaved and pp == 1:
        return False
    ends = [n for n in (c.first, c.last) if n]
    if not ends:
        if c.layers % pp:
            return False
        per_rank = c.layers // pp
    else:
        mid_stages, mid_layers = pp - len(ends), c.layers - sum(ends)
        if mid_stages < 0 or mid_layers < 0 or (mid_stages == 0) != (mid_layers == 0):
            return False
        if mid_stages and mid_layers % mid_stages:
            return False
        per_rank = mid_layers // mid_stages if mid_stages else 0
    if c.vp_layers and per_rank % c.vp_layers:
        return False
    if c.vp_stages and (per_rank % c.vp_stages or any(n % c.vp_stages for n in ends)):
        return False
    if c.gbs % (c.mbs * dp) or dp < c.min_dp:
        return False
    return not (interleaved and (c.gbs // (c.mbs * dp)) % pp)


def brute_force(nodes, c: Case):
    """(most GPUs any legal layout uses, every legal (tp, pp, dp) on that many)."""
    best, layouts = 0, set()
    for counts in itertools.product(*(range(n + 1) for n in nodes)):
        used = sum(counts)
        if used < best or used == 0:
            continue
        group = math.gcd(*counts)
        found = {(tp, pp, used // tp // pp)
                 for tp in range(1, group + 1) if group % tp == 0
                 for pp in range(1, used // tp + 1) if (used // tp) % pp == 0
                 if megatron_accepts(tp, pp, used // tp // pp, counts, c)}
        if found and used > best:
            best, layouts = used, found
        elif found:
            layouts |= found
    return best, layouts


@st.composite
def cases(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32]))
    groups = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    kind = draw(st.sampled_from(["plain", "plain", "vp_layers", "vp_stages", "uneven"]))
    # interleaving needs PP > 1, so give it layer counts with many divisors
    layers = draw(st.integers(1, 32) if kind in ("plain", "uneven") else
                  st.sampled_from([4, 6, 8, 12, 16, 24, 32]))
    extra = {}
    if kind == "vp_layers":
        extra["vp_layers"] = draw(st.sampled_from([v for v in (1, 2, 3, 4) if layers % v == 0]))
    elif kind == "vp_stages":
        extra["vp_stages"] = draw(st.integers(1, 3))
    if kind == "uneven" or (kind == "vp_stages" and draw(st.booleans())):
        extra["first"] = draw(st.none() | st.integers(1, layers))
        extra["last"] = draw(st.none() | st.integers(1, layers))
    mbs = draw(st.integers(1, 4))
    # mostly a global batch Megatron accepts (a multiple of the micro batch)
    gbs = draw(st.integers(1, 96) if draw(st.integers(0, 9)) == 0 else
               st.integers(1, 32).map(lambda k: k * mbs))
    return Case(layers, heads, groups, gbs=gbs, mbs=mbs, min_dp=draw(st.sampled_from([1, 1, 2])),
                max_tp=draw(st.sampled_from([None, None, 2, 4])), **extra)


small_clusters = st.lists(st.integers(0, 6), min_size=1, max_size=4).filter(any)
