"""Megatron-LM's argument names for the GPT example, and the layout checks on them."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="megatron-core GPT pretraining on a synthetic token stream, with eft's hook",
        allow_abbrev=False,
    )
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 * hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--vocab-size", type=int, required=True, help="tokens of the synthetic stream")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (not times TP, unlike "
                        "Megatron-LM: the embedding's shape must not change with the layout)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="default 0 (Megatron-LM: 0.1), so that a resumed run matches an "
                        "uninterrupted one at any layout")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="default 0 (Megatron-LM: 0.1)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true", help="GPU only")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize weights on the CPU (always on without CUDA); the initial "
                        "weights then do not depend on TP")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--bf16", action="store_true", default=None, help="default with CUDA")
    g.add_argument("--fp32", dest="bf16", action="store_false", help="default without CUDA")

    g = p.add_argument_group("training")
    g.add_argument("--global-batch-size", type=int, required=True)
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234, help="weights and the synthetic data")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit after an iteration divisible by this")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None, help="checkpoint directory (eft's CheckpointDir)")
    g.add_argument("--load", default=None, help="resume from the latest complete checkpoint here")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")
    g.add_argument("--no-load-optim", action="store_true", help="load the weights only")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1, help="iterations between stdout lines")
    g.add_argument("--log-file", default=None,
                   help="JSON lines, one per iteration and per save/load, appended by rank 0")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        parser.error("--seq-length exceeds --max-position-embeddings")
    if args.global_batch_size % args.micro_batch_size:
        parser.error("--global-batch-size must be a multiple of --micro-batch-size")
    for name in ("save_interval", "exit_interval", "log_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    args.padded_vocab_size = _round_up(args.vocab_size, args.make_vocab_size_divisible_by)
    return args


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def layout_problems(args, world_size: int) -> list[str]:
    """Why TP x PP x DP does not fit this model and world size (empty: it does)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        return [f"the world size {world_size} is not a multiple of TP x PP"]
    dp = world_size // (tp * pp)
    checks = [
        (args.global_batch_size % (args.micro_batch_size * dp) == 0,
         (f"--global-batch-size {args.global_batch_size} is not a multiple of "
          f"--micro-batch-size x DP = {args.micro_batch_size * dp}")),
        (args.num_layers % pp == 0, f"--num-layers {args.num_layers} is not a multiple of PP"),
        (args.num_attention_heads % tp == 0,
         f"--num-attention-heads {args.num_attention_heads} is not a multiple of TP"),
        ((args.num_query_groups or tp) % tp == 0,
         f"--num-query-groups {args.num_query_groups} is not a multiple of TP"),
        (args.padded_vocab_size % tp == 0,
         f"the padded vocabulary {args.padded_vocab_size} is not a multiple of TP"),
    ]
    return [why for ok, why in checks if not ok]
