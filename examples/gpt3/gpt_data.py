"""The GPT example's data: a deterministic synthetic token stream, the same at every layout."""

from __future__ import annotations

import hashlib

import torch


def sample_tokens(seed: int, index: int, length: int, vocab_size: int) -> torch.Tensor:
    """Global sample ``index``: ``length`` tokens, a function of (seed, index) alone.

    Each sample is an arithmetic progression modulo the vocabulary with a random start
    and stride, so there is something to learn: after two tokens the rest is determined.
    """
    key = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "big") >> 1)
    start, stride = torch.randint(0, vocab_size, (2,), generator=generator).tolist()
    stride = 1 + stride % 16
    return (start + stride * torch.arange(length)) % vocab_size


def micro_batches(args, iteration: int, dp_rank: int, dp_size: int):
    """This DP rank's micro batches of ``iteration``: its slice of the global batch."""
    per_rank = args.global_batch_size // dp_size
    first = iteration * args.global_batch_size + dp_rank * per_rank
    positions = torch.arange(args.seq_length).unsqueeze(0).expand(args.micro_batch_size, -1)
    for m in range(per_rank // args.micro_batch_size):
        start = first + m * args.micro_batch_size
        rows = torch.stack([sample_tokens(args.seed, start + j, args.seq_length + 1, args.vocab_size)
                            for j in range(args.micro_batch_size)])
        yield {
            "tokens": rows[:, :-1].contiguous(),
            "labels": rows[:, 1:].contiguous(),
            "position_ids": positions.contiguous(),
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length, dtype=torch.float32),
        }
