"""Megatron-Bridge's own optimizer setup, train step and checkpointing, with the callback.

Runs in the Bridge environment (``scripts/venv.sh bridge``: megatron-bridge 0.6.2 on the main
environment's megatron-core 0.19.2; ``megatron_offload_testing/bridge_imports.py`` says what is stubbed
and why), on 2 gloo ranks: the harness's bf16 GPT (DistributedOptimizer, overlapped gradient
reduction and parameter gather), its optimizer and scheduler made by Bridge's
``setup_optimizer``, trained by Bridge's ``train_step`` with a real ``ConfigContainer`` and
``GlobalState``, and Bridge's ``CallbackManager`` firing the events where Bridge's ``train()``
fires them. With ``OptimizerStateOffloadCallback``:

* losses, grad norms and the final parameters and optimizer states are bitwise those of the
  same run without it, and every tracked byte is on the host between steps;
* a checkpoint saved by Bridge's ``save_checkpoint`` while offloaded holds bit for bit what the
  run without the callback saves, and no state comes back to the device for it;
* a run resumed from it by Bridge's ``load_checkpoint`` (with the callback) trains the
  remaining steps bitwise as the run that never stopped.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest

from tests.harness.checkpoints import torch_dist_tensors

pytestmark = pytest.mark.bridge  # skipped, with the reason, where Bridge is absent (conftest)

STEPS = 4
SAVE_AT = 2


def _bridge_config(save_dir: str, load_dir: str | None):
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
    )
    from megatron.core.distributed import DistributedDataParallelConfig

    # The harness's GPT (tests/harness/models.py), as Bridge would describe it.
    return ConfigContainer(
        train=TrainingConfig(micro_batch_size=2, global_batch_size=4, train_iters=STEPS),
        model=GPTModelProvider(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=16,
            vocab_size=128,
            bf16=True,
            params_dtype=torch.bfloat16,
        ),
        optimizer=OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            min_lr=0.0,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
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
            seq_length=16,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        logger=LoggerConfig(log_interval=2),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        checkpoint=CheckpointConfig(
            save=save_dir,
            load=load_dir,
            ckpt_format="torch_dist",
            save_tokenizer_assets=False,
            save_optim=True,
            save_rng=True,
        ),
        ddp=DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=3000,
            grad_reduce_in_fp32=True,
        ),
    )


def bridge_job(offload: bool, save_dir: str, resume: bool = False) -> dict:
    """Bridge's train loop pieces on this rank: setup_optimizer, train_step, save/load."""
    from megatron_offload_testing import bridge_imports

    bridge_imports.install()
    import torch
    from megatron.bridge.training.callbacks import CallbackContext, CallbackManager
    from megatron.bridge.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron.bridge.training.optim import setup_optimizer
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.train import force_param_sync, train_step
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_offload.frameworks.bridge import OptimizerStateOffloadCallback
    from tests.harness import models

    cfg = _bridge_config(save_dir, save_dir if resume else None)
    cfg.validate()  # what Bridge's pretrain() does first: finalizes every part
    made = {}

    def make_optimizer(optimizer_config, chunks):
        # Bridge's own setup (its OptimizerConfig, with the harness's values).
        optimizer, scheduler = setup_optimizer(cfg.optimizer, cfg.scheduler, chunks)
        made["scheduler"] = scheduler
        return optimizer

    chunks, optimizer, model_config = models.build(
        "gpt",
        "bf16",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        bucket_size=3000,
        make_optimizer=make_optimizer,
    )
    scheduler = made["scheduler"]
    spec = model_config.harness_spec
    state = GlobalState()
    state.cfg = cfg
    # Bridge's TensorBoard writer (made on the last rank when cfg.logger asks for one), here
    # a recorder on every rank: what the callback writes at the log interval.
    state._tensorboard_logger = _Recorder()
    world = torch.distributed.get_world_size()
    init_num_microbatches_calculator(
        torch.distributed.get_rank(),
        None,
        cfg.train.global_batch_size,
        cfg.train.micro_batch_size,
        world,
    )
    out = {"results": [], "offloaded": [], "tracked": []}
    try:
        if resume:
            for distrib in models.distributed_optimizers(optimizer):
                # megatron-core (0.16-0.19) cannot build a load dict for a torch-AdamW optimizer
                # without state (`assert len(steps) == 1`), with or without offloading; on a
                # GPU, TE's FusedAdam makes its state first. Made here as megatron-core would.
                distrib._init_optimizer_states_with_dummy_values()
            load_checkpoint(state, chunks, optimizer, scheduler)
            # megatron-core's load leaves torch AdamW's per-parameter `step` stale (the value
            # before the load) and shared; an attached offloader repairs it, but Bridge loads
            # before on_train_start attaches one. Repaired here for both runs, as the offloader
            # would (the saved step is in the loaded param groups).
            from megatron_offload.access.methods import restore_step_tensors

            for distrib in models.distributed_optimizers(optimizer):
                restore_step_tensors(
                    distrib.optimizer,
                    {"optimizer": {"param_groups": distrib.optimizer.param_groups}},
                )
            models.flush_param_gather(chunks)
        manager = CallbackManager()
        callback = OptimizerStateOffloadCallback() if offload else None
        if callback is not None:
            manager.add(callback)

        def context(**extra):
            return CallbackContext(
                state=state,
                model=chunks,
                user_state=manager.user_state,
                optimizer=optimizer,
                scheduler=scheduler,
                **extra,
            )

        manager.fire("on_train_start", context())
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        first = state.train_state.step
        for step in range(first, STEPS):
            batches = iter([models._micro_batch(spec, step, 0)])
            loss_dict, skipped, *_rest = train_step(
                functools.partial(models._forward_step, spec),
                batches,
                chunks,
                optimizer,
                scheduler,
                state,
                pg_collection,
                get_forward_backward_func(),
                None,
            )
            grad_norm = _rest[3]
            if model_config.harness_pre_hook_pending and not skipped:
                for chunk in chunks:  # what Bridge's train() does after the first step
                    chunk.enable_forward_pre_hook()
                model_config.harness_pre_hook_pending = False
            state.train_state.step += 1
            out["results"].append((float(loss_dict["lm loss"]), float(grad_norm), bool(skipped)))
            manager.fire(
                "on_train_step_end",
                context(loss_dict=loss_dict, grad_norm=grad_norm, skipped_iter=bool(skipped)),
            )
            if callback is not None:
                figures = callback.offloader.stats()
                out["offloaded"].append(figures["offloaded_bytes"])
                out["tracked"].append(figures["tracked_bytes"])
            if state.train_state.step == SAVE_AT and not resume:
                storages = [t.untyped_storage().nbytes() for t in _state_tensors(optimizer)]
                # What Bridge's save_checkpoint_and_time does around its save: the updated
                # parameters are gathered first (overlapped gather), then saved.
                force_param_sync(chunks, optimizer)
                save_checkpoint(state, chunks, optimizer, scheduler, 0)
                manager.fire("on_checkpoint_save", context())
                out["storage_bytes_around_save"] = (
                    sum(storages),
                    sum(t.untyped_storage().nbytes() for t in _state_tensors(optimizer)),
                )
        manager.fire("on_train_end", context())
        models.flush_param_gather(chunks)
        out["snapshot"] = models.snapshot(chunks, optimizer)
        out["finalize_restored"] = getattr(
            model_config.finalize_model_grads_func, "__megatron_offload_wrapper__", None
        )
        out["detached"] = callback is None or callback.offloader.detached
        out["scalars"] = state._tensorboard_logger.scalars
    finally:
        destroy_num_microbatches_calculator()
    return out


class _Recorder:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, step))


def _state_tensors(optimizer):
    from megatron_offload.adapters import collect
    from megatron_offload.offloader.members import megatron_optimizers as distributed_optimizers

    return [tensor for d in distributed_optimizers(optimizer) for _, tensor in collect(d)]


def _assert_bitwise(reference, other, *, first: int = 0):
    """Bitwise the reference run from its step ``first`` on (a resumed run starts later)."""
    from tests.harness.compare import assert_bitwise_equal

    later = [{**ref, "results": ref["results"][first:]} for ref in reference]
    assert_bitwise_equal(later, other)


def test_bridge_train_step_with_the_callback_is_bitwise_offloaded_and_resumes(rank_pool, tmp_path):
    import torch

    plain_dir, offloaded_dir = str(tmp_path / "plain"), str(tmp_path / "offloaded")
    reference = rank_pool.run(bridge_job, False, plain_dir)
    offloaded = rank_pool.run(bridge_job, True, offloaded_dir)
    _assert_bitwise(reference, offloaded)
    for rank in offloaded:
        # Every tracked byte on the host after every step, and Bridge's hook given back.
        assert rank["tracked"] and all(t > 0 for t in rank["tracked"])
        assert rank["offloaded"] == rank["tracked"]
        # The save was served from the host copy: the states' storages held 0 bytes around it.
        assert rank["storage_bytes_around_save"] == (0, 0)
        assert rank["detached"] and rank["finalize_restored"] is None
        # The figures went to Bridge's writer at its log interval (2), and only then.
        logged = {step for _, step in rank["scalars"]}
        assert logged == {2, 4} and any("offloaded" in name for name, _ in rank["scalars"])
    for rank in reference:
        assert (
            rank["storage_bytes_around_save"][0] > 0
        )  # the control: resident without the callback
        assert rank["scalars"] == []

    # What Bridge wrote while offloaded is bit for bit what it wrote without the callback.
    step_dir = f"iter_{SAVE_AT:07d}"
    plain = torch_dist_tensors(os.path.join(plain_dir, step_dir))
    written = torch_dist_tensors(os.path.join(offloaded_dir, step_dir))
    assert plain.keys() == written.keys() and plain
    different = [k for k in plain if not torch.equal(plain[k], written[k])]
    assert not different, different[:5]

    # Resumed through Bridge's load_checkpoint, with the callback: the last steps bitwise.
    resumed = rank_pool.run(bridge_job, True, offloaded_dir, True)
    _assert_bitwise(reference, resumed, first=SAVE_AT)
    for rank in resumed:
        assert rank["offloaded"] == rank["tracked"] and rank["tracked"]
    shutil.rmtree(tmp_path, ignore_errors=True)
