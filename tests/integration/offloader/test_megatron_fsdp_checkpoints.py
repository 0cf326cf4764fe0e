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


def _build(offload: bool, glu: bool, host, strategy: str, options=None):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "gpt",
        "bf16",
        ddp_overrides={**FSDP, "data_parallel_sharding_strategy": strategy},
        transformer_overrides=SWIGLU if glu else None,
    )
    offloader = (
        megatron_offload.attach(optimizer, device_factory=host, **(options or {}))
        if offload
        else None
    )
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


def _params(optimizer) -> list:
    return [p for group in optimizer.optimizer.param_groups for p in group["params"]]


def _record_state_making(chunks, optimizer, host) -> list[int]:
    """Device bytes of states and masters each time megatron-core's state initializer
    (``init_state_fn``) returns: the offloader makes a load's states with it, one parameter
    at a time (the plain load steps the inner optimizer instead and never calls it)."""
    original, seen = optimizer.init_state_fn, []

    def init_state_fn(*args, **kwargs):
        original(*args, **kwargs)
        seen.append(held_bytes(chunks, optimizer, besides=host.holds))

    optimizer.init_state_fn = init_state_fn
    return seen


@contextlib.contextmanager
def _zeros_like_fails_at(call: int):
    """torch's ``zeros_like`` raises at its ``call``-th call in the block (megatron-core's state
    initializer makes each moment with it)."""
    original, calls = torch.zeros_like, [0]

    def zeros_like(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("injected: out of device memory")
        return original(*args, **kwargs)

    torch.zeros_like = zeros_like
    try:
        yield
    finally:
        torch.zeros_like = original


def _failed_load(chunks, optimizer, offloader, glu, call: int) -> dict:
    """A load whose state making fails at ``zeros_like``'s ``call``-th call: what it left."""
    before = offloader.stats()["host_bytes"]
    try:
        with offloader.host_view(writes=True), _zeros_like_fails_at(call):
            _fsdp_dtensor_state(chunks[0].module, optimizer, glu, is_loading=True)
        error = None
    except RuntimeError as caught:
        error = str(caught)
    return {
        "error": error,
        "states": sum(bool(entries) for entries in dict.values(optimizer.optimizer.state)),
        "host_bytes_grew": offloader.stats()["host_bytes"] - before,
        "offloaded": offloader.is_offloaded,
    }


def fsdp_checkpoint_job(
    offload: bool,
    directory: str,
    glu: bool,
    copy_every_local=False,
    strategy=DEFAULT_STRATEGY,
    load_fault=0,
    options=None,
):
    """``copy_every_local``: the control, ``DTensor.from_local`` copies every tensor as if
    all were host tensors, so the SwiGLU halves are loaded into copies. ``load_fault``: a
    first load fails at that call of ``zeros_like`` while its states are made, and is made
    again. ``options``: ``attach``'s."""
    from torch.distributed import checkpoint as dcp

    from tests.harness import models
    from tests.harness.checkpoints import shared_directory
    from tests.harness.megatron_fsdp import HostRecordingDevice, host_copies_are_copied

    where = shared_directory(directory)
    host = HostRecordingDevice()
    out = {}
    is_host = (lambda tensor: True) if copy_every_local else host.holds
    with host_copies_are_copied(is_host) as copied:
        chunks, optimizer, config, offloader = _build(offload, glu, host, strategy, options)
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
        chunks, optimizer, config, offloader = _build(offload, glu, host, strategy, options)
        if offloader is not None:
            offloader.offload()
        if load_fault:
            out["failed_load"] = _failed_load(chunks, optimizer, offloader, glu, load_fault)
        making = _record_state_making(chunks, optimizer, host)
        # The whole load in a host view (writes), as megatron.training's load runs it.
        with (
            offloader.host_view(writes=True) if offloader is not None else contextlib.nullcontext()
        ):
            raw, state = _fsdp_dtensor_state(chunks[0].module, optimizer, glu, is_loading=True)
            out["held_at_load"] = held_bytes(chunks, optimizer, besides=host.holds)
            dcp.load(state, checkpoint_id=where)
            # load_checkpoint's order: the model (strict=False, as its fallback does: the
            # DTensors were loaded in place above), then the optimizer, then the RNG states.
            chunks[0].load_state_dict(raw["model"], strict=False)
            optimizer.load_state_dict(raw["optimizer"])
            out["held_after_load_calls"] = held_bytes(chunks, optimizer, besides=host.holds)
            del raw, state
        out["held_after_load"] = held_bytes(chunks, optimizer)
        out["states_made"] = making
        out["largest_states"] = max(2 * local(p).numel() * 4 for p in _params(optimizer))
        _set_rng_states(rng)
        resumed = [models.train_step(chunks, optimizer, config, s) for s in steps]
        out["resumed"] = {"results": first + resumed, **_final(chunks, optimizer, offloader)}
    out["host_tensors_copied"] = copied
    out["host_buffers"] = host.made
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
#: The call of ``zeros_like`` at which the faulted run's first load fails: its second
#: parameter's first moment (one parameter's states made, staged and adopted by then).
LOAD_FAULT = 3
#: A chunked update's budget under one update's states (about 574 KB of moments on each rank
#: here), above the two slots the largest shard needs (512 KiB).
CHUNKED = {"chunked_update_bytes": 540 * 1024}
#: name: ``fsdp_checkpoint_job``'s arguments; the control last.
RUNS = {
    **{
        f"{pair}{suffix}": {"offload": offload, "glu": glu, "strategy": strategy}
        for pair, (strategy, glu) in PAIRS.items()
        for offload, suffix in ((False, ""), (True, "-offloaded"))
    },
    "swiglu-offloaded-load-fault": {"offload": True, "glu": True, "load_fault": LOAD_FAULT},
    "swiglu-offloaded-chunked": {"offload": True, "glu": True, "options": CHUNKED},
    "control": {"offload": False, "glu": True, "copy_every_local": True},
}


def fsdp_checkpoint_runs(directory: str) -> dict:
    """Every run, each from the same seeds, in ONE job: a save on a rank process whose earlier
    job's process groups were destroyed fails to resolve its mesh ("Could not resolve the
    process group registered under the name 3"), so these runs share a pool of their own."""
    import os

    from tests.harness.rank_pool import seed_everything

    out = {}
    for name, arguments in RUNS.items():
        seed_everything()
        out[name] = fsdp_checkpoint_job(directory=os.path.join(directory, name), **arguments)
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
        # The load: the states made for it one parameter at a time on the device (never more
        # than the largest parameter's two moments), then only the host copy, written.
        assert ref["held_at_load"] > 0 and ref["states_made"] == []
        assert off["held_at_load"] == off["held_after_load_calls"] == off["held_after_load"] == 0
        assert len(off["states_made"]) > 1
        assert 0 < max(off["states_made"]) <= off["largest_states"]
        assert ref["served_locals"] == 0 and off["served_locals"] > 0
        assert off["uninterrupted"]["offloaded"] and off["resumed"]["offloaded"]
        assert off["host_buffers"] > 0 and off["host_tensors_copied"] == []


def test_a_load_whose_state_making_fails_leaves_nothing_and_runs_again_bitwise(runs):
    """A load fails while it makes the states it writes into (torch's ``zeros_like`` raising
    for the second parameter, after the first one's states were staged to the host): it
    raises, leaves no state, no host memory and everything offloaded; the same load made
    again resumes bitwise as the run whose load never failed."""
    faulted, clean = runs["swiglu-offloaded-load-fault"], runs["swiglu-offloaded"]
    for rank in faulted:
        failed = rank["failed_load"]
        assert failed["error"] == "injected: out of device memory"
        assert failed["states"] == 0 and failed["host_bytes_grew"] == 0 and failed["offloaded"]
        assert rank["held_after_load"] == 0 and len(rank["states_made"]) > 1
    for phase in ("uninterrupted", "resumed"):
        assert_bitwise_equal([r[phase] for r in clean], [r[phase] for r in faulted])


def test_with_the_chunked_update_the_load_is_written_into_the_host_copy_too(runs):
    """The chunked update streams the states a load made on the host like any others: the
    save and the load hold nothing on the device, and both runs are bitwise the plain ones."""
    reference, chunked = runs["swiglu"], runs["swiglu-offloaded-chunked"]
    for phase in ("uninterrupted", "resumed"):
        assert_bitwise_equal([r[phase] for r in reference], [r[phase] for r in chunked])
    for ref, rank in zip(reference, chunked):
        # The budget is under one update's states (two fp32 moments beside the fp32 masters,
        # all on the device at the plain run's save): the update streams them in chunks.
        assert ref["held_at_save"] * 2 // 3 > CHUNKED["chunked_update_bytes"]
        assert rank["held_at_save"] == rank["held_at_load"] == rank["held_after_load"] == 0
        assert rank["resumed"]["offloaded"] and len(rank["states_made"]) > 1
        assert rank["host_tensors_copied"] == []


def test_the_resume_comparison_sees_a_load_written_into_copies(runs):
    """The control: loaded through copies (every local tensor treated as a host tensor), the
    SwiGLU halves never reach the states and masters, and the resume differs."""
    from tests.harness.compare import differences

    for rank in runs["control"]:
        assert rank["host_tensors_copied"]
        assert differences(rank["uninterrupted"], rank["resumed"])
