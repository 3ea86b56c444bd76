"""The vote's process group: gloo, with its connections made on demand.

The vote runs on a gloo group of its own wherever the job's default group is not gloo: on an
NCCL job a vote on the default group is a CUDA all_reduce and a host sync every iteration.
torch's gloo connects a full mesh when a group is made: every rank opens a TCP connection to
each of the N−1 others, each found through the job's store, at every start of the workers
(bench/vote_group.py). The vote needs none of them: its exchange is a binomial tree
(``tree_max.py``), so a rank only ever talks to its tree neighbours, at most ⌈log2 N⌉ + 1
peers, and the group's other users (``all_gather_object`` in ``memory.py`` and ``numerics.py``,
gloo's ring) to two more. So the group connects to a peer at their first message
(torch's ``TORCH_GLOO_LAZY_INIT``, for this group alone: ``torch_seam.lazy_gloo_group``).
"""

from __future__ import annotations

import torch.distributed as dist


def vote_group():
    """A new gloo group over every rank, for the vote (a collective: every rank calls it, in the
    same order as its other ``new_group`` calls) that opens no connection until one is used."""
    from elasticft import torch_seam

    return torch_seam.lazy_gloo_group()


def hook_group(group=None):
    """The group a ``Hook`` votes on: ``group`` when given; else the default group (None) when
    its backend carries the vote's CPU tensors itself (gloo, also "cpu:gloo,cuda:nccl", or MPI:
    its connections exist already); else, as on an NCCL job, a ``vote_group()`` of its own (a
    collective: every rank makes its Hook)."""
    if group is not None:
        return group
    backend = str(dist.get_backend())
    if "gloo" in backend or backend == "mpi":
        return None
    return vote_group()
