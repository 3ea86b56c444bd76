"""What Megatron-LM's ``pretrain_gpt.py`` does otherwise before megatron-core 0.19 (0.17, 0.18):
``pretrain_gpt.py`` beside this file takes these parts from here there, as Megatron-LM's script
takes its model provider from ``model_provider.py`` and ``gpt_builders.py`` beside it.

- ``pretrain`` builds the model through a model provider (Megatron-LM's ``model_provider.py``
  and ``gpt_builders.py`` at core_v0.17.1 and core_v0.18.2; here the local layer spec alone,
  which is what ``cpu_mode`` runs); from 0.19 on it builds it from the config container.
- 0.17: ``pretrain`` parses the arguments itself (``args_defaults``) and takes no config
  container; the batch comes from ``megatron.training.utils``' helpers, which read the data
  iterator themselves; ``mtp_on_this_rank`` takes the model config.
- 0.18: the script parses the arguments and hands ``pretrain`` the config container first;
  the batch comes from ``megatron.core.utils``' helpers as in 0.19, whose ``flatten`` step
  for packed sequences 0.18 does not have.
"""

from __future__ import annotations

from megatron.core import mpu
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.package_info import __version__ as mcore_version
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
from megatron.training import get_args
from megatron.training.arguments import core_transformer_config_from_args

MINOR = tuple(int(part) for part in mcore_version.split(".")[:2])

# The fields 0.18's get_batch_on_this_tp_rank reads from a sample (None where absent).
_TP_KEYS_0_18 = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "hybrid_cp_group", "labels", "local_cp_size",
                 "loss_mask", "max_seqlen", "position_ids", "tokens")
_PACKED = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None) -> GPTModel:
    """model_provider.py's ``model_provider`` with gpt_builders.py's ``gpt_builder``, local spec."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(config.num_moe_experts, config.moe_grouped_gemm, config.qk_layernorm,
                                    config.multi_latent_attention, normalization=config.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def mtp_here(config, vp_stage) -> bool:
    if MINOR < (0, 18):
        return mtp_on_this_rank(config, ignore_virtual=False, vp_stage=vp_stage)
    return mtp_on_this_rank(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                            ignore_virtual=False, vp_stage=vp_stage)


def batch(data_iterator, mtp: bool) -> dict:
    """This rank's micro-batch (no packed sequences): read on TP rank 0, broadcast, split over CP."""
    args = get_args()
    if MINOR < (0, 18):
        from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

        found = get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank=mtp)
        return get_batch_on_this_cp_rank({k: v for k, v in found.items() if k not in _PACKED})
    from megatron.core.parallel_state import get_context_parallel_group, get_hybrid_data_context_parallel_groups
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    tp_rank = mpu.get_tensor_model_parallel_rank()
    found = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        found = {k: sample[k].cuda(non_blocking=True) if sample.get(k) is not None else None for k in _TP_KEYS_0_18}
    found = get_batch_on_this_tp_rank(
        found, is_sft=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=mtp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    return get_batch_on_this_cp_rank(found, is_hybrid_cp=False, cp_group=get_context_parallel_group(),
                                     hybrid_cp_group_func=get_hybrid_data_context_parallel_groups)


def pretrain_gpt(pretrain, datasets_provider, forward_step, store, get_embedding_ranks) -> None:
    """The script's call of ``pretrain`` in 0.17 and 0.18."""
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}
    if MINOR < (0, 18):
        pretrain(datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=defaults, store=store, get_embedding_ranks=get_embedding_ranks)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(args_defaults=defaults)
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, store=store, get_embedding_ranks=get_embedding_ranks)
