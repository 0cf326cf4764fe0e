"""A small GPT trained twice, without and with optimizer-state offloading, side by side.

    torchrun --nproc-per-node 2 examples/train_gpt_offload.py [--steps 10] [--fp32]

Each rank builds the same megatron-core GPTModel (local layer spec) with DDP and the
distributed optimizer, trains it for a few steps, then builds it again from the same seed
and trains it with ``megatron_offload.attach``. Per step it prints both losses (they are
identical) and the bytes this rank keeps on the host instead of the device.

Uses GPUs with NCCL when they exist; on a machine without them it runs on CPU ranks with
gloo, through the CPU redirects of ``megatron_offload_testing.cpu_megatron``.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import torch

# A demo shows what offloading does, not megatron-core's notices about optional packages
# (Transformer Engine, apex, absl), deprecations inside megatron-core and torch.distributed,
# or torch's about a missing CUDA toolkit. (In this demo only: your scripts keep them.)
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")
for logger in ("megatron", "torch.utils.cpp_extension"):
    logging.getLogger(logger).setLevel(logging.ERROR)

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        from megatron_offload_testing import cpu_megatron
    except ImportError as error:
        raise SystemExit(
            "No GPU here: the CPU run needs megatron_offload_testing (the CPU stand-ins for CUDA), "
            "which is not installed with the package; run from the repository root with PYTHONPATH=. "
            f"({error})"
        ) from error

    cpu_megatron.install()


from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer.module import Float16Module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import megatron_offload  # noqa: E402

VOCAB, SEQ, MICRO_BATCH = 256, 32, 4


def build(args, make_optimizer=None):
    """GPT + DDP + DistributedOptimizer, as megatron.training would build them
    (``make_optimizer(model)``: another framework's optimizer setup instead)."""
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=512,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        bf16=args.bf16,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
    )
    if ON_GPU:
        model.cuda()
    if args.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, grad_reduce_in_fp32=args.bf16
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = (
        make_optimizer(model)
        if make_optimizer
        else get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-3,
                bf16=args.bf16,
                use_distributed_optimizer=True,
                clip_grad=1.0,
            ),
            [model],
        )
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    config.grad_sync_func = model.start_grad_sync
    return model, optimizer


def batch(step):
    """Mock tokens, different per data-parallel rank and step, the same on every run."""
    device = torch.cuda.current_device() if ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(1000 * step + parallel_state.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return {
        "tokens": tokens[:, :-1].to(device),
        "labels": tokens[:, 1:].to(device),
        "position_ids": position_ids.to(device),
    }


def forward_step(data_iterator, model):
    data = next(data_iterator)
    losses = model(data["tokens"], data["position_ids"], None, labels=data["labels"])

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return losses, loss_func


def train_step(model, optimizer, step):
    """One step of the loop; returns its loss (the mean over data-parallel ranks)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch(step)]),
        model=[model],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    optimizer.step()  # reloads the states, updates, offloads them again
    loss = losses[0]["lm loss"].clone()
    torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    return loss.item() / parallel_state.get_data_parallel_world_size()


def train(args, offload: bool):
    model, optimizer = build(args)
    offloader = megatron_offload.attach(optimizer) if offload else None  # the one line
    rows = []
    for step in range(args.steps):
        loss = train_step(model, optimizer, step)
        offloaded = offloader.stats()["offloaded_bytes"] if offloader else 0
        rows.append((loss, offloaded))
    return rows, offloader.stats() if offloader else None


def table(ranks) -> str:
    """The demo's output: per step both losses, whether every rank saw them identical, and
    the MiB each rank offloaded; then each rank's host memory and copies."""
    mib = float(1 << 20)
    world = len(ranks)
    offloaded_head = "offloaded MiB " + "/".join(f"r{r}" for r in range(world))
    lines = [
        f"{'step':>4} {'loss (no offload)':>18} {'loss (offload)':>15} {'identical':>9}  {offloaded_head}"
    ]
    plain0, offloaded0, _ = ranks[0]
    for step, ((a, _), (b, _)) in enumerate(zip(plain0, offloaded0)):
        same = all(p[step][0] == o[step][0] for p, o, _ in ranks)
        per_rank = " / ".join(f"{o[step][1] / mib:.2f}" for _, o, _ in ranks)
        lines.append(f"{step:>4} {a:>18.6f} {b:>15.6f} {'yes' if same else 'NO':>9}  {per_rank}")
    identical = all(p[s][0] == o[s][0] for p, o, _ in ranks for s in range(len(p)))
    host = " / ".join(f"{st['host_bytes'] / mib:.2f}" for _, _, st in ranks)
    _, _, first = ranks[0]
    lines.append(
        f"host MiB per rank {host}; copies per cycle {first['d2h_copies']} out + "
        f"{first['h2d_copies']} in; losses identical on every rank and step: "
        f"{'yes' if identical else 'NO'}"
    )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--fp32",
        dest="bf16",
        action="store_false",
        help="fp32 parameters (default: bf16 parameters with fp32 master weights)",
    )
    args = parser.parse_args()

    torch.distributed.init_process_group("nccl" if ON_GPU else "gloo")
    if ON_GPU:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel()
    rank = torch.distributed.get_rank()

    plain, _ = train(args, offload=False)
    offloaded, stats = train(args, offload=True)

    # One table for all ranks: rank 0 prints what every rank saw.
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, (plain, offloaded, stats))
    if rank == 0:
        print(table(ranks), flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
