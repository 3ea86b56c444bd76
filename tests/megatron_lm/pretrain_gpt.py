"""Pretrain a GPT with Megatron-LM's own training loop (megatron-core 0.19.x; 0.17 and 0.18).

The shape of Megatron-LM's ``pretrain_gpt.py``: parse and validate the arguments, build the
model config and the config container from them, and hand the dataset provider and the
forward step to ``megatron.training.pretrain``, which runs unmodified.

The deviations: on a machine without CUDA, ``cpu_emulation`` (beside this file) is
enabled before anything from megatron is imported, so that the loop runs on the CPU with
gloo (``--distributed-backend gloo --transformer-impl local``, fp32); and with
``EFT_TEST_NUMBERS`` set, ``numbers_log`` records each iteration's unrounded numbers for
the tests (observation only). With megatron-core 0.17 or 0.18 installed, the parts of
Megatron-LM's script of that release that differ (the model provider, the batch, pretrain's
call) come from ``gpt_before_0_19`` beside this file.

Launch with torchrun, e.g.::

    torchrun --nproc-per-node 2 tests/megatron_lm/pretrain_gpt.py --mock-data \\
        --tokenizer-type NullTokenizer --vocab-size 128 --distributed-backend gloo ...
"""

# Program start, before the heavy imports (pretrain reports the startup time from it).
import time

_PROGRAM_START_TIME = time.time()

import os
import sys
import warnings

# Only rank 0 shows library warnings (each rank would repeat them).
if int(os.environ.get("RANK", 0)) != 0:
    for _category in (UserWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=_category)

import torch

if not torch.cuda.is_available():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cpu_emulation

    cpu_emulation.enable()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numbers_log  # noqa: E402 - the tests' record of each iteration's numbers (EFT_TEST_NUMBERS)

numbers_log.enable()

from functools import partial
from typing import List, Optional

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.package_info import __version__ as mcore_version
from megatron.core.parallel_state import (
    get_context_parallel_group,
    get_hybrid_data_context_parallel_groups,
)
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.transformer.multi_token_prediction import get_mtp_ranks
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank as _mtp_on_this_rank
from megatron.core.utils import StragglerDetector, get_attr_wrapped_model, get_torch_version
from megatron.training import (
    get_args,
    get_timers,
    inprocess_restart,
    pretrain,
    print_rank_0,
    set_startup_timestamps,
)
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

MINOR = tuple(int(part) for part in mcore_version.split(".")[:2])
if MINOR < (0, 19):
    import gpt_before_0_19 as before
else:
    from megatron.core.utils import (
        flatten_batch_for_packed_sequences,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    )
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

stimer = StragglerDetector()

# The fields get_batch hands to forward_step, in this order.
BATCH_KEYS = ("attention_mask", "labels", "loss_mask", "position_ids", "tokens")

# A loss 10x the largest seen so far counts as a spike.
SPIKY_LOSS_FACTOR = 10


def _mtp_here(config, vp_stage) -> bool:
    """Whether this pipeline stage holds multi-token-prediction layers."""
    if MINOR < (0, 19):
        return before.mtp_here(config, vp_stage)
    return _mtp_on_this_rank(
        layout=config.pipeline_model_parallel_layout,
        mtp_num_layers=config.mtp_num_layers,
        ignore_virtual=False,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator, vp_stage: Optional[int] = None):
    """This rank's micro-batch: read on TP rank 0, broadcast over TP, split over CP."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    mtp_here = _mtp_here(config, vp_stage)

    # Middle pipeline stages take their input from the previous stage.
    if not is_first_or_last_pipeline_stage(vp_stage) and not mtp_here:
        return [None] * len(BATCH_KEYS)
    if MINOR < (0, 19):
        batch = before.batch(data_iterator, mtp_here)
        return [batch.get(key) for key in BATCH_KEYS]

    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        batch = {
            key: (sample[key].cuda(non_blocking=True) if sample.get(key) is not None else None)
            for key in BATCH_KEYS
        }

    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)
    batch = get_batch_on_this_cp_rank(
        batch,
        is_hybrid_cp=False,
        cp_group=get_context_parallel_group(),
        hybrid_cp_group_func=get_hybrid_data_context_parallel_groups,
    )
    return [batch.get(key) for key in BATCH_KEYS]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model: Optional[GPTModel] = None):
    """Sum of the per-token losses under the mask.

    Returns the loss, the number of tokens it covers, and the report the loop averages over
    data-parallel ranks (``lm loss``). Before that reduction, the rerun state machine checks
    this rank's loss for NaN/Inf (fatal) and for a spike (not fatal), as Megatron-LM does.
    """
    args = get_args()

    per_token = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(per_token * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}

    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic
                fatal=True,
            )
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(
                rerun_state_machine.is_unexpectedly_large,
                threshold=SPIKY_LOSS_FACTOR,
                context="loss",
            ),
            message="Spiky loss",
            tolerance=0.0,  # the forward pass is deterministic
            fatal=False,
        )

    return loss, num_tokens, report


# Tests only: EFT_TEST_SLOW=RANK:SECONDS makes that rank's every micro batch slower (a straggler).
_SLOW_RANK, _, _SLOW_SECONDS = os.environ.get("EFT_TEST_SLOW", "").partition(":")


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """One micro-batch forward; returns the output and the loss function to apply to it."""
    args = get_args()
    if _SLOW_RANK and torch.distributed.get_rank() == int(_SLOW_RANK):
        time.sleep(float(_SLOW_SECONDS))
    timers = get_timers()

    timers("batch-generator", log_level=2).start()
    with stimer(bdata=True):
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        attention_mask, labels, loss_mask, position_ids, tokens = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()

    with stimer:
        if return_schedule_plan:
            assert (
                args.overlap_moe_expert_parallel_comm
            ), "the schedule plan is for --overlap-moe-expert-parallel-comm"
            plan = model.build_schedule_plan(
                tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask
            )
            return plan, partial(loss_func, loss_mask, model=model)
        output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)

    return output_tensor, partial(loss_func, loss_mask, model=model)


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """Datasets are read on TP rank 0 of the stages that need tokens or labels."""
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    config = core_transformer_config_from_args(get_args())
    return is_first_or_last_pipeline_stage(vp_stage) or _mtp_here(config, vp_stage)


def core_gpt_dataset_config_from_args(args) -> GPTDatasetConfig:
    """The GPT dataset config the parsed arguments describe."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        fast_cache_load=args.dataloader_fast_cache_load,
        defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Build the train, validation and test datasets (mock ones with ``--mock-data``)."""
    args = get_args()
    config = core_gpt_dataset_config_from_args(args)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    print_rank_0("> building train, validation, and test datasets for GPT ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage),
        config,
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


def get_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The ranks holding word embeddings: the first stage, the last when tied, and MTP stages."""
    ranks = {pp_ranks[0]}
    if len(pp_ranks) > 1:
        args = get_args()
        if not args.untie_embeddings_and_output_weights:
            ranks.add(pp_ranks[-1])
        ranks.update(get_mtp_ranks(pp_ranks, core_transformer_config_from_args(args)))
    return sorted(ranks)


if __name__ == "__main__":
    _MAIN_ENTRY_TIME = time.time()

    print_rank_0(f"> PyTorch version ................ {get_torch_version()}")
    print_rank_0(f"> Megatron-Core version .......... {mcore_version}")

    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=_MAIN_ENTRY_TIME)

    # The loop builds the datasets on the ranks is_dataset_built_on_rank names.
    train_valid_test_datasets_provider.is_distributed = True

    pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    if MINOR < (0, 19):
        before.pretrain_gpt(pretrain, train_valid_test_datasets_provider, forward_step, store, get_embedding_ranks)
    else:
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
        model_cfg = gpt_config_from_args(args)
        full_config = pretrain_cfg_container_from_args(args, model_cfg)
        pretrain(
            full_config,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            store=store,
            get_embedding_ranks=get_embedding_ranks,
        )
