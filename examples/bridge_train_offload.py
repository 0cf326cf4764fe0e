"""Megatron-Bridge's train step, without and with the offload callback, side by side.

    torchrun --nproc-per-node 2 examples/bridge_train_offload.py [--steps 6] [--fp32]
    # on a CPU machine, in the Bridge environment the tests use:
    OMP_NUM_THREADS=1 PYTHONPATH=. $(scripts/venv.sh bridge)/bin/python -m torch.distributed.run \\
        --nproc-per-node 2 examples/bridge_train_offload.py

Each rank builds the GPT of ``train_gpt_offload.py`` with Bridge's own optimizer setup
(``setup_optimizer``: the DistributedOptimizer and its scheduler), then trains it with Bridge's
``train_step``, its ``GlobalState`` and ``CallbackManager`` firing the events where Bridge's
``train()`` fires them: once as it is, once with ``OptimizerStateOffloadCallback`` (what
``pretrain(cfg, forward_step, callbacks=[OptimizerStateOffloadCallback()])`` adds). It prints
both losses per step (identical) and the bytes each rank keeps on the host between steps.

On a machine without a GPU, Bridge's imports of Transformer Engine and nvidia-resiliency-ext
are stubbed (``megatron_offload_testing.bridge_imports``, test-only code).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt_offload as demo  # noqa: E402 - the model, the data, the table (and the CPU stand-ins)

if not demo.ON_GPU:
    from megatron_offload_testing import bridge_imports

    bridge_imports.install()

from megatron.bridge.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron.bridge.training.callbacks import CallbackContext, CallbackManager  # noqa: E402
from megatron.bridge.training.config import (  # noqa: E402
    CheckpointConfig,
    ConfigContainer,
    LoggerConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
)
from megatron.bridge.training.optim import setup_optimizer  # noqa: E402
from megatron.bridge.training.state import GlobalState  # noqa: E402
from megatron.bridge.training.train import train_step  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402
from megatron.core.num_microbatches_calculator import (  # noqa: E402
    destroy_num_microbatches_calculator,
    init_num_microbatches_calculator,
)
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from megatron_offload.frameworks.bridge import OptimizerStateOffloadCallback  # noqa: E402


def bridge_config(args) -> ConfigContainer:
    """What a Bridge recipe says about this run (the model itself is built by the demo)."""
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    world = torch.distributed.get_world_size()
    cfg = ConfigContainer(
        train=TrainingConfig(
            micro_batch_size=demo.MICRO_BATCH,
            global_batch_size=demo.MICRO_BATCH * world,
            train_iters=args.steps,
        ),
        model=GPTModelProvider(
            num_layers=2,
            hidden_size=128,
            num_attention_heads=4,
            ffn_hidden_size=512,
            seq_length=demo.SEQ,
            vocab_size=demo.VOCAB,
            bf16=args.bf16,
            params_dtype=dtype,
        ),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=0.0,
            clip_grad=1.0,
            bf16=args.bf16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
        ),
        scheduler=SchedulerConfig(
            lr_decay_style="constant",
            lr_warmup_iters=0,
            start_weight_decay=0.01,
            end_weight_decay=0.01,
            weight_decay_incr_style="constant",
        ),
        dataset=MockGPTDatasetConfig(
            random_seed=0,
            seq_length=demo.SEQ,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        logger=LoggerConfig(log_interval=args.steps),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=demo.VOCAB),
        checkpoint=CheckpointConfig(save=None),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, grad_reduce_in_fp32=args.bf16
        ),
    )
    cfg.validate()  # what Bridge's pretrain() does first
    return cfg


def train(args, offload: bool):
    cfg = bridge_config(args)
    made = {}

    def make_optimizer(model):
        optimizer, made["scheduler"] = setup_optimizer(cfg.optimizer, cfg.scheduler, [model])
        return optimizer

    model, optimizer = demo.build(args, make_optimizer)
    scheduler = made["scheduler"]
    state = GlobalState()
    state.cfg = cfg
    init_num_microbatches_calculator(
        torch.distributed.get_rank(),
        None,
        cfg.train.global_batch_size,
        cfg.train.micro_batch_size,
        parallel_state.get_data_parallel_world_size(),
    )
    manager = CallbackManager()
    callback = OptimizerStateOffloadCallback() if offload else None  # the one line
    if callback is not None:
        manager.add(callback)

    def context(**extra):
        return CallbackContext(
            state=state,
            model=[model],
            user_state=manager.user_state,
            optimizer=optimizer,
            scheduler=scheduler,
            **extra,
        )

    rows, stats = [], None
    try:
        manager.fire("on_train_start", context())
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        for step in range(args.steps):
            loss_dict, skipped, *_ = train_step(
                demo.forward_step,
                iter([demo.batch(step)]),
                [model],
                optimizer,
                scheduler,
                state,
                pg_collection,
                get_forward_backward_func(),
                None,
            )
            state.train_state.step += 1
            manager.fire(
                "on_train_step_end", context(loss_dict=loss_dict, skipped_iter=bool(skipped))
            )
            loss = loss_dict["lm loss"].clone()
            torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
            loss = loss.item() / parallel_state.get_data_parallel_world_size()
            offloaded = callback.offloader.stats()["offloaded_bytes"] if callback else 0
            rows.append((loss, offloaded))
        if callback is not None:
            stats = callback.offloader.stats()
        manager.fire("on_train_end", context())
    finally:
        destroy_num_microbatches_calculator()
    return rows, stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--fp32",
        dest="bf16",
        action="store_false",
        help="fp32 parameters (default: bf16 parameters with fp32 master weights)",
    )
    args = parser.parse_args()

    torch.distributed.init_process_group("nccl" if demo.ON_GPU else "gloo")
    if demo.ON_GPU:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel()

    plain, _ = train(args, offload=False)
    offloaded, stats = train(args, offload=True)

    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, (plain, offloaded, stats))
    if torch.distributed.get_rank() == 0:
        print(demo.table(ranks), flush=True)
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
