"""GPT pretraining with megatron-core, wired to eft: checkpoints that survive layout changes.

Megatron-LM's argument names, a deterministic synthetic token stream, megatron-core's
GPTModel, schedules and optimizer, torch_dist distributed checkpoints in eft's
CheckpointDir, and eft's per-iteration hook. It runs unchanged under torchrun (the hook
is inert) and eft-run (the planner rewrites --tensor-model-parallel-size and
--pipeline-model-parallel-size at every restart; the checkpoint is resharded on load).

  torchrun --nproc-per-node 4 examples/gpt3/train.py --tensor-model-parallel-size 2 \\
      --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
      --max-position-embeddings 32 --vocab-size 128 --global-batch-size 8 \\
      --micro-batch-size 1 --train-iters 20 --lr 1e-3 --save ckpt --load ckpt --save-interval 5

With CUDA: nccl and bf16. Without: gloo and fp32 through cpu_mode.py, an emulation for
testing. See docs/gpt3.md.

The batch of an iteration does not depend on the layout: iteration i trains on global
samples i*GBS ... i*GBS+GBS-1, data-parallel rank r takes the r-th contiguous slice of
them and splits it into micro batches (gradient accumulation absorbs a smaller DP), and
sample g is a function of (--seed, g) alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import sys
import time
import warnings
from functools import partial

import torch
import torch.distributed as dist

CHECKPOINT_VERSION = 3.0
KEEP_CHECKPOINTS = 2


# -- arguments ---------------------------------------------------------------------------

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


# -- the synthetic token stream ----------------------------------------------------------

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


# -- the run -----------------------------------------------------------------------------

class Trainer:
    def __init__(self, args):
        self.args = args
        # megatron-core's import-time notes about missing optional kernels, once per rank.
        warnings.filterwarnings("ignore", message=r".*(Transformer Engine and )?Apex (is|are) not installed")
        warnings.filterwarnings("ignore", message=r"full scope is deprecated")
        # Megatron-LM's launch scripts set it: TP's async gradient all-reduce wants one
        # CUDA connection (megatron warns otherwise; meaningless in CPU mode).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        self.cuda = torch.cuda.is_available()
        if args.bf16 is None:
            args.bf16 = self.cuda
        if not self.cuda:
            if args.bf16:
                print("CPU mode: --bf16 ignored, training in fp32", file=sys.stderr, flush=True)
                args.bf16 = False
            if args.use_distributed_optimizer:
                raise SystemExit("CPU mode: --use-distributed-optimizer needs CUDA (see cpu_mode.py)")
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import cpu_mode  # beside this file
            cpu_mode.enable()
        self._import_megatron()
        self._init_distributed()
        self._build()

    def _import_megatron(self):
        # After cpu_mode.enable(): some megatron modules bind torch.cuda functions at import.
        global parallel_state, dist_checkpointing, tensor_parallel
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        # A synchronous torch_dist save hands its write results back through a queue that
        # megatron-core creates at the first save of each process from a spawn-method
        # multiprocessing Manager: a new interpreter that re-imports __main__ and costs
        # seconds, at the first save after every (re)start, which is when an emergency
        # save must be quick. This script only saves synchronously, in this process, so
        # an in-process queue is enough.
        if filesystem_async._results_queue is None:
            filesystem_async._results_queue = queue.Queue()

    def _init_distributed(self):
        args = self.args
        backend = args.distributed_backend or ("nccl" if self.cuda else "gloo")
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        problems = layout_problems(args, self.world)
        if problems:
            raise SystemExit(f"TP{tp} x PP{pp} on {self.world} ranks: " + "; ".join(problems))
        self.dp = self.world // (tp * pp)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        self.tp, self.pp = tp, pp
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.first_stage = parallel_state.is_pipeline_first_stage()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        torch.manual_seed(args.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)

    def _build(self):
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.transformer_config import TransformerConfig

        args = self.args
        dtype = torch.bfloat16 if args.bf16 else torch.float32
        config = TransformerConfig(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups,
            hidden_dropout=args.hidden_dropout,
            attention_dropout=args.attention_dropout,
            init_method_std=args.init_method_std,
            layernorm_epsilon=args.layernorm_epsilon,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            pipeline_dtype=dtype,
            params_dtype=dtype,
            bf16=args.bf16,
            use_cpu_initialization=args.use_cpu_initialization or not self.cuda,
            # The local layer spec without TE or apex: no fused kernels.
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=self.first_stage,
            post_process=self.last_stage,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
        )
        if self.cuda:
            model.cuda(torch.cuda.current_device())
        self.core = model  # what checkpoints hold, under Megatron-LM's keys (no "module.")
        if args.bf16:
            # As Megatron-LM's get_model: bf16 inputs on the first stage, fp32 outputs on the last.
            from megatron.core.transformer.module import Float16Module
            model = Float16Module(config, model)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        self.model = DistributedDataParallel(config, ddp_config, model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=args.lr,
                min_lr=args.min_lr,
                weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1,
                adam_beta2=args.adam_beta2,
                adam_eps=args.adam_eps,
                clip_grad=args.clip_grad,
                bf16=args.bf16,
                params_dtype=dtype,
                use_distributed_optimizer=args.use_distributed_optimizer,
            ),
            [self.model],
        )
        gbs = args.global_batch_size
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if args.lr_warmup_iters else args.lr,
            max_lr=args.lr,
            min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * gbs,
            lr_decay_steps=args.lr_decay_iters * gbs,
            lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay,
            end_wd=args.weight_decay,
            wd_incr_steps=args.train_iters * gbs,
            wd_incr_style="constant",
        )
        config.grad_scale_func = self.optimizer.scale_loss
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        self.config = config
        self.forward_backward = get_forward_backward_func()

    # -- one iteration ---------------------------------------------------------------

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        if self.cuda:
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(self._loss, batch["loss_mask"])

    @staticmethod
    def _loss(loss_mask, output):
        losses = output.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask) / mask.sum()
        # The schedule divides the returned loss in place: report a copy.
        return loss, {"lm loss": loss.detach().clone()}

    def train_step(self, iteration: int):
        args = self.args
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        num_micro = args.global_batch_size // (args.micro_batch_size * self.dp)
        reduced = self.forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=micro_batches(args, iteration, self.dp_rank, self.dp),
            model=[self.model],
            num_microbatches=num_micro,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=args.global_batch_size)
        # The mean over the global batch: each last-stage rank of TP rank 0 sends the sum
        # of its micro batches' mean losses; every micro batch has the same token count.
        total = torch.zeros(2, dtype=torch.float64, device=self._device())
        if self.last_stage and parallel_state.get_tensor_model_parallel_rank() == 0:
            total[0] = sum(float(r["lm loss"]) for r in reduced)
            total[1] = len(reduced)
        dist.reduce(total, dst=0)
        loss = (total[0] / total[1]).item() if self.rank == 0 else None
        return loss, (float(grad_norm) if grad_norm is not None else None), ok

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    # -- checkpoints -----------------------------------------------------------------

    def _state(self, is_loading: bool) -> dict:
        model_state = self.core.sharded_state_dict()
        state = {"model": model_state, "checkpoint_version": CHECKPOINT_VERSION}
        if not (is_loading and self.args.no_load_optim):
            state["optimizer"] = self.optimizer.sharded_state_dict(model_state, is_loading=is_loading)
            state["opt_param_scheduler"] = self.scheduler.state_dict()
        return state

    def save(self, checkpoints, iteration: int) -> tuple[str, float]:
        started = time.time()
        path = checkpoints.path_for(iteration)
        if self.rank == 0:
            # A directory left by an abandoned timeline: start it empty.
            for entry in os.scandir(path):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        dist.barrier()
        state = self._state(is_loading=False)
        state["iteration"] = iteration
        state["args"] = {k: v for k, v in vars(self.args).items()}
        state["layout"] = {"world_size": self.world, "tp": self.tp, "pp": self.pp, "dp": self.dp}
        dist_checkpointing.save(state, str(path), sharded_strategy=("torch_dist", 1))
        dist.barrier()  # every rank's shards are on storage
        if self.rank == 0:
            checkpoints.commit(iteration)
        return str(path), time.time() - started

    def load(self, path, iteration: int) -> dict:
        """CheckpointDir's load_fn: every rank fails or none (torch_dist agrees on errors)."""
        from torch.distributed.checkpoint.api import CheckpointException

        state = self._state(is_loading=True)
        try:
            loaded = dist_checkpointing.load(state, str(path))
        except CheckpointException as err:
            # A BaseException, which CheckpointDir.load_latest would not catch: it could
            # not fall back to the previous checkpoint.
            raise RuntimeError(f"torch_dist could not read {path}: {err}") from None
        if loaded.get("iteration") != iteration:
            raise RuntimeError(f"checkpoint {path} holds iteration {loaded.get('iteration')}, not {iteration}")
        self.core.load_state_dict(loaded["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        return loaded.get("layout", {})


class Log:
    """Rank 0's records: JSON lines to --log-file, a short line to stdout."""

    def __init__(self, path, rank: int):
        # Open for the whole run, line-buffered: a killed run keeps every finished line.
        self.file = open(path, "a", buffering=1) if path and rank == 0 else None  # noqa: SIM115
        self.rank = rank

    def record(self, **fields):
        if self.file is not None:
            self.file.write(json.dumps({**fields, "time": time.time()}) + "\n")

    def say(self, text: str):
        if self.rank == 0:
            print(text, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    trainer = Trainer(args)
    from elasticft.worker import CheckpointDir, Hook

    rank = trainer.rank
    log = Log(args.log_file, rank)
    layout = {"world_size": trainer.world, "tp": trainer.tp, "pp": trainer.pp, "dp": trainer.dp}
    iteration = 0
    if args.load:
        started = time.time()
        loaded_at, saved_layout = CheckpointDir(args.load, keep=KEEP_CHECKPOINTS).load_latest(trainer.load)
        if loaded_at is not None:
            iteration = loaded_at
            seconds = time.time() - started
            log.record(event="load", iteration=iteration, seconds=seconds, path=args.load,
                       saved_layout=saved_layout, **layout)
            log.say(f"loaded iteration {iteration} from {args.load} in {seconds:.2f} s "
                    f"(saved at {_layout_text(saved_layout)}, now {_layout_text(layout)})")
        elif CheckpointDir(args.load).complete_iterations():
            # Starting over would overwrite the run's history; a person must look.
            raise SystemExit(f"none of the complete checkpoints in {args.load} loads (see the warnings)")
        else:
            log.say(f"no checkpoint to load in {args.load}: starting from iteration 0")
    checkpoints = CheckpointDir(args.save, keep=KEEP_CHECKPOINTS) if args.save else None
    # On GPU the vote goes over gloo, so it does not synchronise the GPU every iteration.
    group = dist.new_group(backend="gloo") if trainer.cuda else None
    hook = Hook(save_interval=args.save_interval, last_saved_iteration=iteration, group=group)
    log.record(event="start", iteration=iteration, train_iters=args.train_iters, **layout)
    log.say(f"training {_layout_text(layout)} from iteration {iteration} to {args.train_iters}"
            f"{' (CPU mode, fp32)' if not trainer.cuda else ', bf16' if args.bf16 else ''}")

    last_saved = iteration if args.load and iteration else None
    while iteration < args.train_iters:
        started = time.time()
        loss, grad_norm, ok = trainer.train_step(iteration)
        iteration += 1
        seconds = time.time() - started
        log.record(event="iteration", iteration=iteration, loss=loss, grad_norm=grad_norm,
                   lr=trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
                   skipped=not ok, seconds=seconds, **layout)
        if rank == 0 and (iteration % args.log_interval == 0 or iteration == args.train_iters):
            log.say(f"iteration {iteration:6d}/{args.train_iters} | loss {loss:.6f} | "
                    f"{seconds * 1000:.0f} ms")
        action = hook.step(iteration)
        periodic = args.save_interval is not None and iteration % args.save_interval == 0
        exit_now = args.exit_interval is not None and iteration % args.exit_interval == 0
        if (action.save or periodic or exit_now) and checkpoints is not None:
            path, seconds = trainer.save(checkpoints, iteration)
            last_saved = iteration
            hook.saved(iteration, path, seconds)
            reason = action.reason or ("interval" if periodic else "exit_interval")
            log.record(event="save", iteration=iteration, seconds=seconds, path=path, reason=reason, **layout)
            log.say(f"saved iteration {iteration} in {seconds:.2f} s ({reason})")
        elif action.save:
            log.say(f"iteration {iteration}: asked to save ({action.reason}) but there is no --save")
        if action.exit or exit_now:
            reason = action.reason if action.exit else "exit_interval"
            log.record(event="exit", iteration=iteration, reason=reason, **layout)
            log.say(f"exiting at iteration {iteration} ({reason})")
            break
    else:
        if checkpoints is not None and last_saved != iteration:
            path, seconds = trainer.save(checkpoints, iteration)
            hook.saved(iteration, path, seconds)
            log.record(event="save", iteration=iteration, seconds=seconds, path=path, reason="end", **layout)
            log.say(f"saved iteration {iteration} in {seconds:.2f} s (end of training)")
        log.record(event="end", iteration=iteration, **layout)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _layout_text(layout: dict) -> str:
    if not layout:
        return "an unknown layout"
    return f"TP{layout['tp']}xPP{layout['pp']}xDP{layout['dp']} ({layout['world_size']} ranks)"


# Mandatory: megatron-core's torch_dist save starts a spawn-method multiprocessing Manager
# (unless its results queue was replaced, as _import_megatron does), which re-imports
# __main__; without this guard every save would start another training run and hang.
if __name__ == "__main__":
    sys.exit(main())
