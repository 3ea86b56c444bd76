"""Cost model for the planner: estimated step time and per-GPU memory of one layout.

Pure arithmetic on nominal hardware. The numbers rank layouts against each other;
they are not a prediction of a real run's speed (docs/planner.md explains each term).
"""

from __future__ import annotations

# Nominal hardware. Only the ratios matter for the ranking: sustained bf16 matmul
# throughput of one GPU, ring bus bandwidth inside a node (NVLink) and per GPU across
# nodes (one 400 Gb/s NIC per GPU).
GPU_FLOPS = 400e12
NVLINK_BYTES_PER_S = 300e9
NETWORK_BYTES_PER_S = 50e9

# Mixed-precision Adam without the distributed optimizer: bf16 weights (2) + fp32
# gradients (4) + fp32 master weights (4) + two fp32 moments (8).
STATE_BYTES_PER_PARAM = 18
# Activation bytes per layer per token per hidden unit, bf16, with sequence
# parallelism and flash attention and no recomputation (Korthikanti et al. 2022: 34/TP).
ACTIVATION_BYTES_PER_ELEMENT = 34
BYTES_PER_GB = 1e9

# Used only for the ranking when the model's sizes are not given.
NOMINAL_HEAD_DIM = 128
NOMINAL_SEQ_LENGTH = 2048


def hidden_and_seq(model) -> tuple[int, int]:
    """The model's hidden size and sequence length, or nominal values for ranking."""
    hidden = model.hidden_size or NOMINAL_HEAD_DIM * model.num_attention_heads
    return hidden, model.seq_length or NOMINAL_SEQ_LENGTH


def total_params(model, hidden: int) -> float:
    """``model.params`` when known, else a GPT estimate: attention with grouped KV,
    a 4h MLP, and the (tied) word embedding."""
    if model.params:
        return float(model.params)
    kv = hidden * model.num_query_groups / model.num_attention_heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 8 * hidden * hidden
    return model.num_layers * per_layer + (model.vocab_size or 0) * hidden


def memory_gb(model, batch, tp: int, pp: int, stage_layers: int, vp: int | None,
              microbatches: int) -> float | None:
    """Estimated peak memory of the busiest GPU in GB, or None when sizes are unknown.

    Weights and optimizer state: 18 bytes per parameter of the largest stage, split over
    TP. Activations: the first stage holds min(PP, microbatches) microbatches in flight
    under 1F1B, a (1 + (PP-1)/(PP*VP)) share more with the interleaved schedule.
    """
    if model.hidden_size is None or model.seq_length is None:
        return None
    hidden, seq = model.hidden_size, model.seq_length
    stage_share = stage_layers / model.num_layers
    state = STATE_BYTES_PER_PARAM * total_params(model, hidden) * stage_share / tp
    per_layer = ACTIVATION_BYTES_PER_ELEMENT * seq * batch.micro_batch_size * hidden / tp
    in_flight = min(pp, microbatches)
    if vp is not None:
        in_flight *= 1 + (pp - 1) / (pp * vp)
    return (state + per_layer * stage_layers * in_flight) / BYTES_PER_GB


def step_seconds(model, batch, tp: int, pp: int, dp: int, stage_layers: int,
                 vp: int | None, microbatches: int) -> tuple[float, float]:
    """(estimated seconds per global batch, pipeline bubble fraction).

    Per microbatch the busiest stage computes 6·params·tokens·(its share of layers)/TP
    FLOPs, does 4 TP all-reduces of one activation per layer over NVLink (2(TP-1)/TP of
    the bytes each) and sends and receives one activation per model chunk to the next
    stage over the network. The pipeline adds a bubble of (PP-1)/(VP·m + PP-1) of the
    step. Data-parallel gradient reduction is taken as overlapped with the backward
    pass (Megatron's --overlap-grad-reduce) and not charged.
    """
    hidden, seq = hidden_and_seq(model)
    tokens = batch.micro_batch_size * seq
    stage_share = stage_layers / model.num_layers
    compute = 6 * total_params(model, hidden) * tokens * stage_share / tp / GPU_FLOPS
    activation_bytes = 2 * tokens * hidden
    tp_comm = 0.0
    if tp > 1:
        tp_comm = stage_layers * 4 * 2 * (tp - 1) / tp * activation_bytes / NVLINK_BYTES_PER_S
    chunks = vp or 1
    p2p = 2 * chunks * activation_bytes / NETWORK_BYTES_PER_S if pp > 1 else 0.0
    bubble = (pp - 1) / (chunks * microbatches + pp - 1)
    busy = microbatches * (compute + tp_comm + p2p)
    return busy / (1 - bubble), bubble
