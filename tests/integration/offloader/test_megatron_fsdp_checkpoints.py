"""fsdp_dtensor checkpoints under Megatron-FSDP, saved and loaded while offloaded, on 2 gloo ranks.

Each run trains SAVE_AFTER steps, saves (torch DCP, the state dict built as megatron.training
builds it), trains on to CHECKPOINT_STEPS (the uninterrupted run); then a fresh model and
optimizer, offloaded before anything (a restarted job), load the checkpoint as
megatron.training's ``load_checkpoint`` does and train the same steps (the resumed run).
Shown for every sharding strategy, with and without gated linear units (SwiGLU, whose
linear_fc1 states and masters megatron-core re-wraps in halves for the checkpoint):
- the resumed run is bitwise the uninterrupted one (results and every rank's shards);
- both are bitwise the same runs without offloading;
- the save, in a host view as megatron.training's synchronous save runs it, holds no byte
  of states and masters on the device while torch DCP writes them: the local tensors of the
  DTensors it writes, the SwiGLU halves megatron-core re-wraps included, are the host copy;
- nothing was served from the offloader's host memory: ``DTensor.from_local`` is made to copy
  host tensors, as it does on a GPU, so a load through a served host tensor would write a
  copy and leave the host copy stale (the resume would differ).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.harness.compare import assert_bitwise_equal
from tests.harness.megatron_fsdp import FSDP, dtensors_in, held_bytes, local, snapshot

DEFAULT_STRATEGY = FSDP["data_parallel_sharding_strategy"]

SAVE_AFTER, CHECKPOINT_STEPS = 2, 4
SWIGLU = {"gated_linear_unit": True, "activation_func": torch.nn.functional.silu}


def _fsdp_dtensor_state(module, optimizer, glu: bool, is_loading: bool = False):
    """(the raw state dict, the one given to torch DCP), built as megatron.training builds them
    for the fsdp_dtensor format from ``module``, the MegatronFSDP module its ``unwrap_model``
    leaves. Loading (``is_loading``), megatron-core first steps the inner optimizer on zero
    gradients to make its states."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_swiglu_in_state_dict

    raw = {"model": module.state_dict_for_save_checkpoint()}
    raw["optimizer"] = optimizer.sharded_state_dict(
        raw, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"}
    )
    state = dict(raw)
    if glu:
        state["model"], state["optimizer"] = handle_swiglu_in_state_dict(
            module, state["model"], state["optimizer"]
        )
    preprocess_state_dict_for_uneven_dtensor(state)
    return raw, state


def _build(offload: bool, glu: bool, host, strategy: str):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "gpt",
        "bf16",
        ddp_overrides={**FSDP, "data_parallel_sharding_strategy": strategy},
        transformer_overrides=SWIGLU if glu else None,
    )
    offloader = megatron_offload.attach(optimizer, device_factory=host) if offload else None
    return chunks, optimizer, config, offloader


def _final(chunks, optimizer, offloader) -> dict:
    offloaded = offloader.is_offloaded if offloader is not None else None
    if offloader is not None:
        offloader.reload()
        offloader.wait()
    return {"snapshot": snapshot(chunks, optimizer), "offloaded": offloaded}


def _rng_states():
    from megatron.core import tensor_parallel

    return torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()


def _set_rng_states(states) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(states[0])
    tensor_parallel.get_cuda_rng_tracker().set_states(states[1])


def fsdp_checkpoint_job(
    offload: bool, directory: str, glu: bool, copy_every_local=False, strategy=DEFAULT_STRATEGY
):
    """``copy_every_local``: the control, ``DTensor.from_local`` copies every tensor as if
    all were host tensors, so the SwiGLU halves are loaded into copies."""
    from torch.distributed import checkpoint as dcp

    from tests.harness import models
    from tests.harness.checkpoints import shared_directory
    from tests.harness.megatron_fsdp import HostRecordingDevice, host_copies_are_copied

    where = shared_directory(directory)
    host = HostRecordingDevice()
    out = {}
    is_host = (lambda tensor: True) if copy_every_local else host.holds
    with host_copies_are_copied(is_host) as copied:
        chunks, optimizer, config, offloader = _build(offload, glu, host, strategy)
        first = [models.train_step(chunks, optimizer, config, s) for s in range(SAVE_AFTER)]
        # The whole save in a host view, as megatron.training's synchronous save runs it.
        with offloader.host_view() if offloader is not None else contextlib.nullcontext():
            _, state = _fsdp_dtensor_state(chunks[0].module, optimizer, glu)
            # Device bytes of states and masters while the write reads them (the host copy
            # is not counted: on the CPU harness it is memory of the same kind).
            out["held_at_save"] = held_bytes(chunks, optimizer, besides=host.holds)
            out["served_locals"] = sum(host.holds(local(t)) for t in dtensors_in(state))
            dcp.save(state, checkpoint_id=where)
            del state
        out["held_after_save"] = held_bytes(chunks, optimizer)
        # megatron.training saves these in the checkpoint (rng_state) and restores them on load:
        # the model's dropout draws from them.
        rng = _rng_states()
        steps = range(SAVE_AFTER, CHECKPOINT_STEPS)
        rest = [models.train_step(chunks, optimizer, config, s) for s in steps]
        out["uninterrupted"] = {"results": first + rest, **_final(chunks, optimizer, offloader)}

        torch.manual_seed(99)  # another initialization: everything must come from the checkpoint
        chunks, optimizer, config, offloader = _build(offload, glu, host, strategy)
        if offloader is not None:
            offloader.offload()
        raw, state = _fsdp_dtensor_state(chunks[0].module, optimizer, glu, is_loading=True)
        dcp.load(state, checkpoint_id=where)
        # load_checkpoint's order: the model (strict=False, as its fallback does: the
        # DTensors were loaded in place above), then the optimizer, then the RNG states.
        chunks[0].load_state_dict(raw["model"], strict=False)
        optimizer.load_state_dict(raw["optimizer"])
        _set_rng_states(rng)
        del raw, state
        resumed = [models.train_step(chunks, optimizer, config, s) for s in steps]
        out["resumed"] = {"results": first + resumed, **_final(chunks, optimizer, offloader)}
    out["host_tensors_copied"] = copied
    out["host_buffers"] = len(host.ranges)
    return out


#: The compared pairs (each run without and with offloading): (sharding strategy, gated linear
#: units). megatron-core itself cannot save SwiGLU under no_shard (its parameters carry no
#: ``megatron_fsdp_slice``), offloading or not: no_shard is shown without.
PAIRS = {
    "gelu": (DEFAULT_STRATEGY, False),
    "swiglu": (DEFAULT_STRATEGY, True),
    "optim_grads-swiglu": ("optim_grads", True),
    "optim-swiglu": ("optim", True),
    "no_shard-gelu": ("no_shard", False),
}
#: name: (offload, gated linear units, copy every local tensor, strategy); the control last.
RUNS = {
    **{
        f"{pair}{suffix}": (offload, glu, False, strategy)
        for pair, (strategy, glu) in PAIRS.items()
        for offload, suffix in ((False, ""), (True, "-offloaded"))
    },
    "control": (False, True, True, DEFAULT_STRATEGY),
}


def fsdp_checkpoint_runs(directory: str) -> dict:
    """Every run, each from the same seeds, in ONE job: a save on a rank process whose earlier
    job's process groups were destroyed fails to resolve its mesh ("Could not resolve the
    process group registered under the name 3"), so these runs share a pool of their own."""
    import os

    from tests.harness.rank_pool import seed_everything

    out = {}
    for name, (offload, glu, copy_every_local, strategy) in RUNS.items():
        seed_everything()
        out[name] = fsdp_checkpoint_job(
            offload, os.path.join(directory, name), glu, copy_every_local, strategy
        )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run name: one result per rank}."""
    from tests.harness.rank_pool import RankPool

    with RankPool(2) as pool:
        ranks = pool.run(fsdp_checkpoint_runs, str(tmp_path_factory.mktemp("fsdp_dtensor")))
    return {name: [rank[name] for rank in ranks] for name in RUNS}


@pytest.mark.parametrize("pair", list(PAIRS))
def test_fsdp_dtensor_resume_while_offloaded_is_bitwise_the_uninterrupted_run(runs, pair):
    reference, offloaded = runs[pair], runs[f"{pair}-offloaded"]
    for run in (reference, offloaded):
        assert_bitwise_equal([r["uninterrupted"] for r in run], [r["resumed"] for r in run])
    for phase in ("uninterrupted", "resumed"):
        assert_bitwise_equal([r[phase] for r in reference], [r[phase] for r in offloaded])
    for ref, off in zip(reference, offloaded):
        assert ref["held_at_save"] > 0  # the measure sees the bytes
        assert off["held_at_save"] == off["held_after_save"] == 0
        assert ref["served_locals"] == 0 and off["served_locals"] > 0
        assert off["uninterrupted"]["offloaded"] and off["resumed"]["offloaded"]
        assert off["host_buffers"] > 0 and off["host_tensors_copied"] == []


def test_the_resume_comparison_sees_a_load_written_into_copies(runs):
    """The control: loaded through copies (every local tensor treated as a host tensor), the
    SwiGLU halves never reach the states and masters, and the resume differs."""
    from tests.harness.compare import differences

    for rank in runs["control"]:
        assert rank["host_tensors_copied"]
        assert differences(rank["uninterrupted"], rank["resumed"])
