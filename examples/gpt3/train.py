"""GPT pretraining with megatron-core, wired to eft: checkpoints that survive layout changes.

Megatron-LM's argument names, a deterministic synthetic token stream, megatron-core's
GPTModel, schedules and optimizer, torch_dist distributed checkpoints in eft's
CheckpointDir, and eft's per-iteration hook. It runs unchanged under torchrun (the hook
is inert) and eft-run (the planner rewrites --tensor-model-parallel-size and
--pipeline-model-parallel-size at every restart; the checkpoint is resharded on load).

With CUDA: nccl and bf16. Without: gloo and fp32 through cpu_mode.py, an emulation for
testing. docs/gpt3.md has command lines to run it with.

The batch of an iteration does not depend on the layout: iteration i trains on global
samples i*GBS ... i*GBS+GBS-1, data-parallel rank r takes the r-th contiguous slice of
them and splits it into micro batches (gradient accumulation absorbs a smaller DP), and
sample g is a function of (--seed, g) alone.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from functools import partial

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # siblings, also when loaded by path

from gpt_args import layout_problems, parse_args  # noqa: E402
from gpt_data import micro_batches  # noqa: E402
from resume import resume  # noqa: E402
from run_log import Log, layout_text, log_async_save  # noqa: E402

__eft_preload__ = ("gpt_preload",)  # eft-run's warm workers: megatron-core ahead of need (docs/warm-workers.md)
CHECKPOINT_VERSION = 3.0
KEEP_CHECKPOINTS = 2


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
        self.injector = None  # main() sets it: --eft-inject faults that act inside the step
        self.iteration = 0

    def _import_megatron(self):
        # After cpu_mode.enable(): some megatron modules bind torch.cuda functions at import.
        global parallel_state, dist_checkpointing, tensor_parallel
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
        from elasticft.worker.snapshot import in_process_results_queue

        in_process_results_queue()  # no spawn-method Manager at the first save of each process

    def _init_distributed(self):
        args = self.args
        backend = args.distributed_backend or ("nccl" if self.cuda else "gloo")
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        from elasticft.worker.phases import watch_process_group

        watch_process_group()  # eft report: imports end at the next call, the process group at its return
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

    def _loss(self, loss_mask, output):
        losses = output.float().view(-1)
        mask = loss_mask.view(-1).float()
        loss = torch.sum(losses * mask) / mask.sum()
        if self.injector is not None:  # --eft-inject nan/poison/corrupt: this rank computes bad numbers
            loss = self.injector.loss(self.iteration + 1, loss)
        # The schedule divides the returned loss in place: report a copy.
        return loss, {"lm loss": loss.detach().clone()}

    def train_step(self, iteration: int):
        """One step on batch ``iteration``: (the job's mean loss on rank 0, else None; this
        rank's own mean loss if it computes one, else None; the gradient norm; whether the
        optimizer stepped)."""
        args = self.args
        self.iteration = iteration
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
        own = sum(float(r["lm loss"]) for r in reduced) / len(reduced) if self.last_stage and reduced else None
        if self.last_stage and parallel_state.get_tensor_model_parallel_rank() == 0:
            total[0] = sum(float(r["lm loss"]) for r in reduced)
            total[1] = len(reduced)
        dist.reduce(total, dst=0)
        loss = (total[0] / total[1]).item() if self.rank == 0 else None
        return loss, own, (float(grad_norm) if grad_norm is not None else None), ok

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

    def checkpoint_state(self, iteration: int) -> dict:
        """What a checkpoint holds, on disk and in memory alike."""
        state = self._state(is_loading=False)
        state["iteration"] = iteration
        state["args"] = {k: v for k, v in vars(self.args).items()}
        state["layout"] = {"world_size": self.world, "tp": self.tp, "pp": self.pp, "dp": self.dp}
        return state

    def save(self, checkpoints, iteration: int) -> tuple[str, float]:
        started = time.time()
        path = checkpoints.path_for(iteration)
        if self.rank == 0:
            checkpoints.empty(iteration)  # a directory left by an abandoned timeline
        dist.barrier()
        dist_checkpointing.save(self.checkpoint_state(iteration), str(path), sharded_strategy=("torch_dist", 1))
        dist.barrier()  # every rank's shards are on storage
        if self.rank == 0:
            checkpoints.commit(iteration)
        return str(path), time.time() - started

    def load(self, path, iteration: int) -> dict:
        """CheckpointDir's and the memory tier's load_fn; loading twice leaves the second's state."""
        state = self._state(is_loading=True)
        loaded = dist_checkpointing.load(state, str(path))
        if loaded.get("iteration") != iteration:
            raise RuntimeError(f"checkpoint {path} holds iteration {loaded.get('iteration')}, not {iteration}")
        self.core.load_state_dict(loaded["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(loaded["optimizer"])
            # megatron's scheduler adds a checkpoint's steps to its own: a second load must not add twice
            self.scheduler.num_steps = 0
            self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
        return loaded.get("layout", {})


def main(argv=None) -> int:
    args = parse_args(argv)
    trainer = Trainer(args)
    from elasticft.worker import CheckpointDir, Hook, MemoryCheckpoints
    from elasticft.worker.async_save import AsyncSaves
    from elasticft.worker.inject import FaultInjector

    rank = trainer.rank
    log = Log(args.log_file, rank)
    layout = {"world_size": trainer.world, "tp": trainer.tp, "pp": trainer.pp, "dp": trainer.dp}
    checkpoints = CheckpointDir(args.save, keep=KEEP_CHECKPOINTS) if args.save else None
    # On GPU the vote goes over gloo, so it does not synchronise the GPU every iteration.
    group = dist.new_group(backend="gloo") if trainer.cuda else None
    hook = Hook(save_interval=args.save_interval, group=group)
    memory = MemoryCheckpoints(hook)  # --eft-mem-ckpt-interval under eft-run; inert otherwise
    memory.guard(trainer.optimizer)  # its step() waits for a snapshot's copy: the copy overlaps forward and backward
    iteration, source = resume(trainer, memory, args, log, layout, KEEP_CHECKPOINTS)
    saves = AsyncSaves(hook, checkpoints) if checkpoints is not None else None  # periodic saves, off the loop
    hook.last_saved_iteration = iteration
    injector = trainer.injector = FaultInjector.from_env()  # --eft-inject: demo and test faults, off otherwise
    log.record(event="start", iteration=iteration, train_iters=args.train_iters, source=source, **layout)
    log.say(f"training {layout_text(layout)} from iteration {iteration} to {args.train_iters}"
            f"{' (CPU mode, fp32)' if not trainer.cuda else ', bf16' if args.bf16 else ''}")

    last_saved = iteration if source == "disk" else None
    in_memory = memory.last_complete
    while iteration < args.train_iters:
        started = time.time()
        if hook.skips(iteration + 1):  # its batch gave the same bad numbers twice (data_skipped)
            loss = own_loss = grad_norm = None
            ok = False
            log.say(f"iteration {iteration + 1}: skipping its batch (bad data)")
        else:
            loss, own_loss, grad_norm, ok = trainer.train_step(iteration)
        iteration += 1
        seconds = time.time() - started
        log.record(event="iteration", iteration=iteration, loss=loss, own_loss=own_loss, grad_norm=grad_norm,
                   lr=trainer.scheduler.get_lr(trainer.optimizer.param_groups[0]),
                   skipped=not ok, seconds=seconds, **layout)
        if rank == 0 and loss is not None and (iteration % args.log_interval == 0 or iteration == args.train_iters):
            log.say(f"iteration {iteration:6d}/{args.train_iters} | loss {loss:.6f} | "
                    f"{seconds * 1000:.0f} ms")
        action = hook.step(iteration, loss=own_loss, grad_norm=grad_norm)
        if action.rollback:  # bad numbers: this state must not be saved; the agent restarts us
            memory.flush()  # the snapshot in flight holds an older, good state
            if saves is not None and (done := saves.flush()) is not None:
                log_async_save(log, done, saves, checkpoints, layout)
            log.record(event="rollback", iteration=iteration, loss=loss, own_loss=own_loss, **layout)
            log.say(f"iteration {iteration}: bad numbers (loss {loss}); stopping to re-run it from the last good state")
            break
        if saves is not None and (done := saves.step()) is not None:
            log_async_save(log, done, saves, checkpoints, layout)
        periodic = args.save_interval is not None and iteration % args.save_interval == 0
        exit_now = args.exit_interval is not None and iteration % args.exit_interval == 0
        if (action.save or exit_now) and checkpoints is not None:
            memory.flush()  # the snapshot in flight first: both tiers write through torch_dist
            saves.flush()
            with hook.section("checkpointing"):  # timed against --eft-timeouts' checkpointing
                path, seconds = trainer.save(checkpoints, iteration)
            last_saved = iteration
            hook.saved(iteration, path, seconds)
            reason = action.reason or "exit_interval"
            log.record(event="save", iteration=iteration, seconds=seconds, path=path, reason=reason, **layout)
            log.say(f"saved iteration {iteration} in {seconds:.2f} s ({reason})")
        elif periodic and checkpoints is not None:
            memory.flush()
            saves.start(iteration, trainer.checkpoint_state(iteration))  # written in the background
            last_saved = iteration
        elif action.save:
            log.say(f"iteration {iteration}: asked to save ({action.reason}) but there is no --save")
        if action.exit or exit_now:
            memory.flush()
            reason = action.reason if action.exit else "exit_interval"
            log.record(event="exit", iteration=iteration, reason=reason, **layout)
            log.say(f"exiting at iteration {iteration} ({reason})")
            break
        if saves is None or not saves.pending:  # one torch_dist write in flight at a time
            memory.step(iteration, lambda: trainer.checkpoint_state(iteration))  # noqa: B023 - called now
        if memory.last_complete != in_memory:
            in_memory = memory.last_complete
            log.record(event="mem_saved", iteration=in_memory, stall=memory.last_stall, seconds=memory.last_seconds,
                       **layout)
        injector.after_iteration(iteration)
    else:
        memory.flush()
        if saves is not None and (done := saves.flush()) is not None:
            log_async_save(log, done, saves, checkpoints, layout)
        if checkpoints is not None and last_saved != iteration:
            with hook.section("checkpointing"):
                path, seconds = trainer.save(checkpoints, iteration)
            hook.saved(iteration, path, seconds)
            log.record(event="save", iteration=iteration, seconds=seconds, path=path, reason="end", **layout)
            log.say(f"saved iteration {iteration} in {seconds:.2f} s (end of training)")
        log.record(event="end", iteration=iteration, **layout)
    hook.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


# Mandatory: megatron-core's torch_dist save starts a spawn-method multiprocessing Manager (unless
# _import_megatron replaced its results queue), re-importing __main__: unguarded, every save would hang.
if __name__ == "__main__":
    sys.exit(main())
