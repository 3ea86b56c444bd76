"""The vote's exchange: the element-wise MAX of a few int64 over a group, in 2·⌈log2 N⌉ hops.

torch's gloo all_reduce runs gloo's ring: for a tensor of a few int64 that is 2·(N−1)
dependent sends, linear in the ranks (bench/vote_scale.py). A binomial tree reduces to
group rank 0 and broadcasts back: each rank sends and receives at most ⌈log2 N⌉ small
messages and the longest chain is 2·⌈log2 N⌉ hops, 28 at 16,384 ranks. Point-to-point
sends on a gloo group use their own slots, apart from the group's collectives, so they
cannot be confused with the training's. NCCL groups keep ``all_reduce``: NCCL picks a tree
for small messages itself, and pairwise sends would open a communicator per pair.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TAG = 0x4546  # "EF": the vote's point-to-point messages


def tree_max_(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` becomes the element-wise MAX over the group's ranks (every rank calls it)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return tensor
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    incoming = torch.empty_like(tensor)
    step = 1
    while step < size:  # up: at each level, the odd multiple of step sends to its even neighbour
        if rank % (2 * step):
            dist.send(tensor, peer(rank - step), group=group, tag=TAG)
            break
        if rank + step < size:
            dist.recv(incoming, peer(rank + step), group=group, tag=TAG)
            torch.maximum(tensor, incoming, out=tensor)
        step *= 2
    # down: rank r hears from r minus its lowest set bit, then tells r + each smaller power of two
    if rank:
        lowest = rank & -rank
        dist.recv(tensor, peer(rank - lowest), group=group, tag=TAG)
        step = lowest // 2
    else:
        step = 1 << max(0, (size - 1).bit_length() - 1)
    while step:
        if rank + step < size:
            dist.send(tensor, peer(rank + step), group=group, tag=TAG)
        step //= 2
    return tensor


def group_max(values: list[int], group, device: torch.device) -> list[int]:
    """The element-wise MAX of ``values`` over the group: a tree on CPU (gloo), else all_reduce."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    if device.type == "cpu" and dist.get_world_size(group) > 2:
        tree_max_(tensor, group)
    else:  # two ranks: one exchange either way; NCCL: its own tree
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
