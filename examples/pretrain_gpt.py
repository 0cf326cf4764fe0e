"""Pretrain a GPT model with megatron.training.pretrain on mock data.

A stock-style Megatron pretrain script (the structure of Megatron-LM's pretrain_gpt.py): parse
and validate Megatron's arguments, build the config container, call ``pretrain``. It follows
the ``megatron.training`` line installed: 0.19 and later build the model from the config
container; 0.18 passes a model provider with the container; 0.17 passes the model provider
and lets ``pretrain`` parse the arguments. It contains no offloading code: run it through the launcher to get
``--offload-optimizer-states``:

    torchrun --nproc-per-node 2 -m megatron_offload.launch examples/pretrain_gpt.py \\
        <Megatron flags> --use-distributed-optimizer --offload-optimizer-states

On GPUs it runs with NCCL as is. Where no GPU exists it redirects megatron-core's CUDA
assumptions to the CPU (``megatron_offload_testing``) so the same command trains on CPU
ranks with ``--distributed-backend gloo`` and the CPU flags listed in examples/README.md.
"""

import inspect
import os
from functools import partial

import torch

if not torch.cuda.is_available():
    # No accelerator: run megatron-core and megatron.training on CPU processes (gloo).
    try:
        from megatron_offload_testing import cpu_training
    except ImportError as error:
        raise SystemExit(
            "No GPU here: the CPU run needs megatron_offload_testing (the CPU stand-ins for CUDA), "
            "which is not installed with the package; run from the repository root with PYTHONPATH=. "
            f"({error})"
        ) from error

    cpu_training.install()

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.training import arguments as training_arguments
from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage


def use_prebuilt_dataset_helpers():
    """The megatron-core wheel ships its compiled dataset helpers but not their Makefile, and
    initialization runs ``make`` on rank 0 (which exits when it fails). Skip the build when the
    compiled module is already importable; a source tree with a Makefile still builds."""
    from megatron.core.datasets import utils as dataset_utils

    helpers_dir = os.path.dirname(dataset_utils.__file__)
    if os.path.exists(os.path.join(helpers_dir, "Makefile")):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def get_batch(data_iterator, vp_stage=None):
    """The next micro-batch on the first and last pipeline stages (None elsewhere).

    Every tensor-parallel rank of those stages reads the (identical) mock samples itself, so no
    broadcast within the tensor-parallel group is needed.
    """
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    device = torch.cuda.current_device()

    def to_device(name):
        tensor = batch.get(name)
        return None if tensor is None else tensor.to(device, non_blocking=True)

    return tuple(
        to_device(name)
        for name in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    )


def loss_func(loss_mask, output_tensor):
    """Sum of the masked token losses, the token count, and the pair Megatron reports."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    if not args.mock_data:
        raise SystemExit("examples/pretrain_gpt.py trains on mock data only: pass --mock-data.")
    print_rank_0("> building mock GPT datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset,
        train_val_test_num_samples,
        partial(is_first_or_last_pipeline_stage, vp_stage),
        config,
    ).build()


# Datasets are built on every rank that reads data (see get_batch), not only on rank 0.
train_valid_test_datasets_provider.is_distributed = True


def model_provider(
    pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None
):
    """The GPT model, for the lines whose ``pretrain`` takes a model provider (0.17, 0.18):
    megatron-core's local layer spec (``--transformer-impl local``), as their
    pretrain_gpt.py builds it."""
    args = get_args()
    print_rank_0("building GPT model ...")
    if config is None:
        config = training_arguments.core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts,
        moe_grouped_gemm=args.moe_grouped_gemm,
        qk_layernorm=args.qk_layernorm,
        normalization=args.normalization,
    )
    kwargs = dict(
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
    )
    accepted = inspect.signature(GPTModel.__init__).parameters
    for name, value in (("vp_stage", vp_stage), ("pg_collection", pg_collection)):
        if value is not None and name in accepted:
            kwargs[name] = value
    return GPTModel(**kwargs)


def main():
    use_prebuilt_dataset_helpers()
    defaults = {"tokenizer_type": "NullTokenizer"}
    if "cfg_container" not in inspect.signature(pretrain).parameters:
        # 0.17: pretrain() parses and validates the arguments itself.
        pretrain(
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            args_defaults=defaults,
        )
        return
    from megatron.training import argument_utils

    args = training_arguments.parse_and_validate_args(args_defaults=defaults)
    if hasattr(argument_utils, "gpt_config_from_args"):
        # 0.19 and later: the model is built from the config container.
        container = argument_utils.pretrain_cfg_container_from_args(
            args, argument_utils.gpt_config_from_args(args)
        )
        pretrain(
            container,
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )
    else:
        # 0.18: the container holds the training configuration, the provider the model.
        pretrain(
            argument_utils.pretrain_cfg_container_from_args(args),
            train_valid_test_datasets_provider,
            model_provider,
            ModelType.encoder_or_decoder,
            forward_step,
        )


if __name__ == "__main__":
    main()
