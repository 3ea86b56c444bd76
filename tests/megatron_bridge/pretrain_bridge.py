"""Pretrain a tiny GPT with Megatron-Bridge's own loop, the way a Bridge recipe script does.

A recipe (``tiny_gpt``) builds the ``ConfigContainer``; Hydra-style ``key=value`` arguments
override it (Bridge's ``process_config_with_overrides``, as its example scripts take them);
``megatron.bridge.training.pretrain`` runs it with Bridge's GPT ``forward_step``. Nothing in it
knows about eft. Bridge is imported inside ``main`` and the recipe, not at the top: torch_dist's
save starts a helper with multiprocessing's spawn, which runs this file's top again (a top-level
import of Bridge costs that helper seconds of CPU at each generation's first save). The deviation:
on a machine without CUDA, ``cpu_emulation`` (beside this file) is enabled before megatron is
imported, and the recipe asks for what ``cpu_mode`` needs (gloo,
the local transformer implementation, fp32). With ``EFT_TEST_SNAPSHOTS`` set, Megatron-LM's
``numbers_log`` records each memory snapshot a node reports (observation only); the tests read
each iteration's numbers from Bridge's own log line.

    torchrun --nproc-per-node 2 tests/megatron_bridge/pretrain_bridge.py \\
        checkpoint.save=/tmp/ckpt train.train_iters=20 model.tensor_model_parallel_size=2
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

SEQ_LENGTH = 32
VOCAB = 128


def tiny_gpt(save: str | None = None):
    """The recipe: a 2-layer GPT on mock data, saved every 10 iterations in torch_dist (a constant
    learning rate after the warm-up: the numbers of a step do not depend on train_iters)."""
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        FaultToleranceConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )

    on_cpu = not torch.cuda.is_available()
    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
        seq_length=SEQ_LENGTH, vocab_size=VOCAB, make_vocab_size_divisible_by=VOCAB,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=False, fp16=False,
        transformer_layer_spec=local_layer_spec if on_cpu else GPTModelProvider.transformer_layer_spec,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(micro_batch_size=2, global_batch_size=8, train_iters=20, exit_signal_handler=True),
        validation=ValidationConfig(eval_iters=0, eval_interval=1000),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, bf16=False, fp16=False,
                                  use_distributed_optimizer=True, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=2, start_weight_decay=0.01, end_weight_decay=0.01),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False,
                                          check_for_nan_in_grad=False),
        dataset=MockGPTDatasetConfig(seq_length=SEQ_LENGTH, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     data_sharding=True, dataloader_type="single", num_workers=0),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        logger=LoggerConfig(log_interval=1),
        checkpoint=CheckpointConfig(save=save, load=save, save_interval=10, ckpt_format="torch_dist",
                                    fully_parallel_save=False, async_save=False),
        dist=DistributedInitConfig(distributed_backend="gloo" if on_cpu else "nccl"),
        rng=RNGConfig(seed=1234),
        ft=FaultToleranceConfig(enable_ft_package=False),  # NVRx's rank monitor: on under its ft_launcher
    )


def slowed(forward_step):
    """Tests only: EFT_TEST_SLOW=RANK:SECONDS makes that rank's every micro batch slower (a straggler)."""
    rank, _, seconds = os.environ.get("EFT_TEST_SLOW", "").partition(":")
    if not rank:
        return forward_step
    import functools
    import time

    import torch.distributed as dist

    @functools.wraps(forward_step)  # Bridge reads the step function's signature
    def slow_forward_step(*args, **kwargs):
        if dist.get_rank() == int(rank):
            time.sleep(float(seconds))
        return forward_step(*args, **kwargs)

    return slow_forward_step


def main(overrides: list[str]) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.path.insert(0, _HERE)
        import cpu_emulation

        cpu_emulation.enable()
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    config = process_config_with_overrides(tiny_gpt(), cli_overrides=overrides)
    if config.checkpoint.save and not config.checkpoint.load:
        config.checkpoint.load = config.checkpoint.save  # resume where it saves, as the recipes do
    if os.environ.get("EFT_TEST_SNAPSHOTS"):
        sys.path.insert(0, os.path.join(_HERE, "..", "megatron_lm"))
        import numbers_log

        numbers_log.record_snapshots(os.environ["EFT_TEST_SNAPSHOTS"])
    pretrain(config, slowed(forward_step))


if __name__ == "__main__":  # torch_dist's spawn helper imports this file again
    main(sys.argv[1:])
