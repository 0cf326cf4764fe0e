"""Small Megatron models, trained the way megatron/training/training.py trains them.

Run inside a rank job (see rank_pool). Public API:

    model_chunks, optimizer, config = build(model='mlp' | 'gpt', dtype='fp32' | 'bf16' | 'fp16', ...)
    stats = train_step(model_chunks, optimizer, config, step_index, micro_batches=1)
    snap = snapshot(model_chunks, optimizer)

The model is wrapped like Megatron's get_model() does (Float16Module for bf16, then
megatron.core.distributed.DistributedDataParallel with the distributed optimizer) and the
optimizer comes from megatron.core.optimizer.get_megatron_optimizer. On CPU without
Transformer Engine or apex the inner optimizer is torch.optim.AdamW.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.enums import ModelType
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from .gloo import allow_uneven_all_gather

__all__ = [
    "HarnessSpec",
    "build",
    "distributed_optimizers",
    "flush_param_gather",
    "megatron_optimizers",
    "optimizer_classes",
    "snapshot",
    "storage_facts",
    "train_step",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class HarnessSpec:
    """What train_step needs to know about a built model (stored as `config.harness_spec`)."""

    model: str
    dtype: str
    seq_length: int
    micro_batch_size: int
    hidden: int
    vocab_size: int
    data_seed: int


class MLP(MegatronModule):
    """Stacked tensor-parallel feed-forward blocks on [seq, batch, hidden] activations.

    Each block is ColumnParallelLinear -> GELU -> RowParallelLinear, so every block adds four
    parameters (two weights, two biases) and small bucket sizes give several buckets. Blocks
    are split evenly across pipeline stages; the last stage returns the per-token squared
    error, shaped [batch, seq] like GPTModel's per-token loss.
    """

    def __init__(
        self, config: TransformerConfig, pre_process=True, post_process=True, vp_stage=None
    ):
        super().__init__(config=config)
        self.vp_stage = vp_stage  # read by Float16Module to find the first and last chunk
        # Virtual pipeline: every stage holds vpp chunks, each with its share of the blocks.
        pp_size = parallel_state.get_pipeline_model_parallel_world_size() * _vpp_size()
        if config.num_layers % pp_size:
            raise ValueError(
                f"num_layers={config.num_layers} is not divisible by pp x vpp={pp_size}"
            )
        # Looked up on the unwrapped model by the schedules and, with pp > 1, by
        # finalize_model_grads (GPTModel defines both itself).
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.pre_process = pre_process
        self.post_process = post_process
        self.input_tensor = None
        self.blocks = torch.nn.ModuleList()
        for _ in range(config.num_layers // pp_size):
            up = ColumnParallelLinear(
                config.hidden_size,
                config.ffn_hidden_size,
                config=config,
                init_method=config.init_method,
                bias=True,
                gather_output=False,
                skip_bias_add=False,
            )
            down = RowParallelLinear(
                config.ffn_hidden_size,
                config.hidden_size,
                config=config,
                init_method=config.output_layer_init_method,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            )
            self.blocks.append(torch.nn.ModuleList([up, down]))

    def set_input_tensor(self, input_tensor):
        # Called by the pipeline schedule on non-first stages with the received activations.
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(self, inputs, targets=None):
        hidden = inputs if self.pre_process else self.input_tensor
        for up, down in self.blocks:
            out, _ = up(hidden)
            out, _ = down(torch.nn.functional.gelu(out))
            hidden = hidden + out
        if not self.post_process:
            return hidden
        return (hidden.float() - targets.float()).pow(2).mean(dim=-1).transpose(0, 1).contiguous()


def _vpp_size() -> int:
    """Model chunks per pipeline stage (1 without virtual pipeline parallelism)."""
    return parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1


def _transformer_config(spec_model, dtype, num_layers, hidden, heads, **overrides):
    params_dtype = _DTYPES[dtype]
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    kwargs = dict(
        virtual_pipeline_model_parallel_size=vpp,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=2 * hidden if spec_model == "mlp" else 4 * hidden,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",
        # The fused CUDA kernels these select do not exist on the CPU (same as the CLI flags
        # --no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion).
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        # Allocate on the "current device" and initialize through the model-parallel RNG
        # tracker, as a GPU run does (exercises the redirected CUDA RNG).
        use_cpu_initialization=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _build_module(spec: HarnessSpec, config: TransformerConfig, vp_stage: int | None = None):
    pre_process = parallel_state.is_pipeline_first_stage(
        ignore_virtual=vp_stage is None, vp_stage=vp_stage
    )
    post_process = parallel_state.is_pipeline_last_stage(
        ignore_virtual=vp_stage is None, vp_stage=vp_stage
    )
    if spec.model == "mlp":
        return MLP(config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    if spec.model == "gpt":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return GPTModel(
            config=config,
            # MoE layers when the config asks for experts (transformer_overrides).
            transformer_layer_spec=get_gpt_layer_local_spec(
                num_experts=config.num_moe_experts, moe_grouped_gemm=False
            ),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            # pretrain_gpt's default (embeddings tied unless --untie-...).
            share_embeddings_and_output_weights=True,
            position_embedding_type="learned_absolute",
        )
    raise ValueError(f"model must be 'mlp' or 'gpt', got {spec.model!r}")


#: A mixture-of-experts GPT: four experts, two per token, expert-parallel over two ranks.
MOE = dict(
    num_moe_experts=4,
    moe_router_topk=2,
    moe_token_dispatcher_type="allgather",
    expert_model_parallel_size=2,
)


def build(
    model: str = "mlp",
    dtype: str = "fp32",
    *,
    overlap_grad_reduce: bool = False,
    overlap_param_gather: bool = False,
    bucket_size: int | None = None,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab_size: int = 128,
    seq_length: int = 16,
    micro_batch_size: int = 2,
    lr: float = 1e-3,
    weight_decay: float = 0.01,
    clip_grad: float = 1.0,
    grad_reduce_in_fp32: bool | None = None,
    data_seed: int = 0,
    transformer_overrides: dict | None = None,
    ddp_overrides: dict | None = None,
    optimizer_overrides: dict | None = None,
    optimizer: str = "adam",
    use_distributed_optimizer: bool = True,
    layer_wise: bool = False,
    make_optimizer=None,
    freeze: str | None = None,
):
    """Build (model_chunks, optimizer, config) for the current parallel_state.

    Tensor, pipeline and virtual pipeline parallelism come from parallel_state (one model
    chunk per virtual pipeline stage; virtual pipeline for the mlp model only); num_layers
    must be divisible by the pipeline size times the virtual pipeline size.

    grad_reduce_in_fp32: None means Megatron's default (True for bf16, via
        --accumulate-allreduce-grads-in-fp32 being forced on for bf16).
    bucket_size: DDP bucket size in elements. DDP ignores it (one bucket per buffer) unless
        overlap_grad_reduce is on; then 1000 gives 4 buckets for the default 'mlp' and 3000
        gives 9 for the default 'gpt'.
    *_overrides: extra fields for TransformerConfig / DistributedDataParallelConfig /
        OptimizerConfig.
    optimizer: OptimizerConfig.optimizer ('adam', 'sgd', or an emerging optimizer such as
        'lion', 'muon', 'soap', which need the emerging-optimizers package).
    use_distributed_optimizer: False builds what Megatron builds without
        --use-distributed-optimizer: Float16OptimizerWithFloat16Params (bf16/fp16) or
        FP32Optimizer (fp32), each rank holding every parameter's state.
    layer_wise: for emerging optimizers, what megatron.training builds from
        --use-distributed-optimizer: DDP without the distributed optimizer and a
        LayerWiseDistributedOptimizer (each rank updates whole parameters of its own).
    make_optimizer: ``make_optimizer(optimizer_config, model_chunks)`` builds the optimizer
        instead of megatron-core's ``get_megatron_optimizer`` (a framework's own setup).
    freeze: parameters whose name contains it are frozen before DDP wraps the model (in no
        buffer, without optimizer state: a LoRA base model's weights).
    The returned config is the model config the schedule uses; its training hooks
    (finalize_model_grads_func, grad_scale_func, no_sync_func, ...) are set as
    megatron.training.training.train() sets them.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if overlap_param_gather and not overlap_grad_reduce:
        # Same rule as megatron/training/arguments.py.
        raise ValueError("overlap_param_gather requires overlap_grad_reduce")
    if grad_reduce_in_fp32 is None:
        grad_reduce_in_fp32 = dtype == "bf16"
    if layer_wise:
        # megatron/training/arguments.py: an emerging optimizer with --use-distributed-optimizer
        # turns the distributed optimizer off and the layer-wise one on.
        use_distributed_optimizer = False
    if overlap_param_gather and not (use_distributed_optimizer or layer_wise):
        raise ValueError("overlap_param_gather needs the distributed (or layer-wise) optimizer")
    spec = HarnessSpec(
        model=model,
        dtype=dtype,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        hidden=hidden,
        vocab_size=vocab_size,
        data_seed=data_seed,
    )
    config = _transformer_config(
        model, dtype, num_layers, hidden, heads, **(transformer_overrides or {})
    )
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None and model != "mlp":
        raise ValueError("the harness builds virtual pipeline chunks for the mlp model only")
    modules = [
        _build_module(spec, config, vp_stage) for vp_stage in (range(vpp) if vpp else [None])
    ]
    if dtype in ("bf16", "fp16"):
        modules = [Float16Module(config, module) for module in modules]
    for module in modules if freeze else ():
        for name, param in module.named_parameters():
            if freeze in name:
                param.requires_grad_(False)

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        bucket_size=bucket_size,
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        **(ddp_overrides or {}),
    )
    # One chunk per virtual pipeline stage (one without virtual pipeline); as Megatron's
    # get_model, only the first chunk's buffers are split into buckets. DP replicas start
    # equal because every DP rank draws the same init seed (Megatron broadcasts only with
    # --data-parallel-random-init).
    if ddp_config.use_megatron_fsdp:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        # Megatron-FSDP allocates its gradient buckets inside post-accumulate-grad hooks,
        # where the device-rewriting mode is not active: its device is given here.
        model_chunks = [
            FullyShardedDataParallel(
                config=config, ddp_config=ddp_config, module=module, device=torch.device("cpu")
            )
            for module in modules
        ]
    else:
        model_chunks = [
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=module, disable_bucketing=index > 0
            )
            for index, module in enumerate(modules)
        ]

    optimizer_name = optimizer
    if layer_wise:
        optimizer_overrides = {
            "use_layer_wise_distributed_optimizer": True,
            **(optimizer_overrides or {}),
        }
        allow_uneven_all_gather()
    optimizer_config = OptimizerConfig(
        optimizer=optimizer_name,
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=clip_grad,
        bf16=dtype == "bf16",
        fp16=dtype == "fp16",  # dynamic loss scaling: steps with inf/nan grads are skipped
        params_dtype=_DTYPES[dtype],
        use_distributed_optimizer=use_distributed_optimizer,
        **(optimizer_overrides or {}),
    )
    optimizer = (make_optimizer or get_megatron_optimizer)(optimizer_config, model_chunks)

    # Training hooks, as megatron.training.training.train() installs them
    # (align_grad_reduce defaults to True; align_param_gather is off without virtual PP).
    config.grad_scale_func = optimizer.scale_loss
    config.timers = None
    if overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in model_chunks]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model_chunks]
        if len(model_chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
            config.grad_sync_func = config.grad_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_param_gather:
        # train() starts with the forward pre-hook disabled (so a bad initialization cannot
        # propagate through the first all-gather) and enables it after the first successful
        # step; train_step below does the enabling.
        for chunk in model_chunks:
            chunk.disable_forward_pre_hook(param_sync=False)
    config.harness_spec = spec
    config.harness_pre_hook_pending = overlap_param_gather
    return model_chunks, optimizer, config


# --------------------------------------------------------------------------------------------
# Data and one training step
# --------------------------------------------------------------------------------------------


def _micro_batch(spec: HarnessSpec, step_index: int, micro_index: int) -> dict:
    """Deterministic per (step, micro-batch, data-parallel rank); equal across TP/PP ranks."""
    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(
        ((spec.data_seed * 1_000_003 + step_index) * 1009 + micro_index) * 101 + dp_rank
    )
    s, b = spec.seq_length, spec.micro_batch_size
    if spec.model == "mlp":
        return {
            "inputs": torch.randn(s, b, spec.hidden, generator=gen),
            "targets": torch.randn(s, b, spec.hidden, generator=gen),
            "loss_mask": torch.ones(b, s),
        }
    tokens = torch.randint(0, spec.vocab_size, (b, s + 1), generator=gen)
    # Megatron's get_ltor_masks_and_position_ids: True marks a masked (future) position.
    causal = torch.tril(torch.ones(1, 1, s, s)) < 0.5
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        "attention_mask": causal,
        "loss_mask": torch.ones(b, s),
    }


def _loss_func(loss_mask, output_tensor):
    # pretrain_gpt.loss_func: (sum of token losses, token count, reporting pair); the schedule
    # divides by the token count and by the number of micro-batches.
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    reporting = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting}


def _forward_step(spec: HarnessSpec, data_iterator, model):
    batch = next(data_iterator)
    if spec.model == "mlp":
        output = model(batch["inputs"], batch["targets"])
    else:
        output = model(
            batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )
    return output, partial(_loss_func, batch["loss_mask"])


def step_on(model_chunks, optimizer, config, batches: list) -> tuple:
    """One iteration on these micro-batches, as megatron.training's train_step runs it;
    returns the schedule's reduced losses, whether the update happened and the grad norm,
    as they come (no host synchronization)."""
    spec: HarnessSpec = config.harness_spec
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    # The interleaved schedule takes one iterator per model chunk.
    data = [iter(batches) for _ in model_chunks] if len(model_chunks) > 1 else iter(batches)
    losses_reduced = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, spec),
        data_iterator=data,
        model=model_chunks,
        num_microbatches=len(batches),
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        decoder_seq_length=None,
        forward_only=False,
    )
    update_successful, grad_norm, _num_zeros = optimizer.step()
    if update_successful and config.harness_pre_hook_pending:
        for chunk in model_chunks:
            chunk.enable_forward_pre_hook()
        config.harness_pre_hook_pending = False
    return losses_reduced, update_successful, grad_norm


def train_step(model_chunks, optimizer, config, step_index: int, micro_batches: int = 1) -> dict:
    """One iteration of megatron.training.training.train_step.

    Order: zero_grad_buffer() on every chunk and optimizer.zero_grad() before the forward;
    forward/backward through get_forward_backward_func() (gradient accumulation over
    `micro_batches`, finalize_model_grads, overlap hooks); optimizer.step().
    Returns {'loss': float | None (None off the last pipeline stage), 'grad_norm': float | None,
    'update_successful': bool}. The loss is the token-weighted mean over micro-batches and
    data-parallel ranks, as train_step reports 'lm loss'.
    """
    spec: HarnessSpec = config.harness_spec
    batches = [_micro_batch(spec, step_index, i) for i in range(micro_batches)]
    losses_reduced, update_successful, grad_norm = step_on(model_chunks, optimizer, config, batches)
    loss = None
    if losses_reduced:
        total = torch.vstack([x["lm loss"].view(-1) for x in losses_reduced]).sum(dim=0)
        torch.distributed.all_reduce(
            total, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        loss = (total[0] / total[1]).item()
    if isinstance(grad_norm, torch.Tensor):
        grad_norm = grad_norm.item()
    return {
        "loss": loss,
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "update_successful": bool(update_successful),
    }


def flush_param_gather(model_chunks) -> None:
    """Finish a pending overlapped param all-gather, as Megatron does around a checkpoint save.

    With overlap_param_gather the gather of the freshly stepped params is issued by the next
    forward, so between steps the non-owned parts of the model params are stale.
    """
    for chunk in model_chunks:
        # The pre-hook is enabled only after the first successful update (see build): while
        # it is not, no update happened and the parameters are in sync.
        if chunk.ddp_config.overlap_param_gather and chunk.remove_forward_pre_hook_handles:
            chunk.disable_forward_pre_hook(param_sync=True)
            chunk.enable_forward_pre_hook()


def final_snapshot(model_chunks, optimizer, offloader=None) -> dict:
    """``snapshot`` after the last step: the states brought back first when ``offloader`` is
    given, and the pending parameter all-gather finished."""
    if offloader:
        offloader.reload()
        offloader.wait()
    flush_param_gather(model_chunks)
    return snapshot(model_chunks, optimizer)


# Inspection helpers live in inspection.py; re-exported here for the jobs that use them.
from .inspection import (  # noqa: E402
    distributed_optimizers,
    megatron_optimizers,
    optimizer_classes,
    snapshot,
    storage_facts,
)
