"""A chunked step that fails part-way is undone: nothing it changed stays changed.

The chunked update runs the inner step as several calls (``integration/chunked.py``). Here a
call fails after earlier calls updated their parameters and their states were copied back to
the host: the call raises before updating (out of memory for TE's temporaries), or after
writing (a kernel that failed part-way), or one device copy of the step raises (each copy of
the step in turn). Afterwards every parameter, group step, state and scale is byte for byte
as before the step, no state the step created is left, the error says the step was undone,
and retrying it gives the bytes of a run that never failed. With the undo turned off the same
failures leave parameters changed (the control: the comparison can fail).

Driven directly on the checked device (every ordering of the undo's copies is checked), in
the isolated process, for torch AdamW, the apex FusedAdam double and the Transformer Engine
FusedAdam double (precision-aware: bf16 parameters, masters in the state; FP8, bf16, fp16 and
fp32 moments, with and without remainders).
"""

from __future__ import annotations

import pytest

from tests.unit.chunked.test_refusal import (
    _build,
    _grads,
    _kinds,
    _per_param_need,
    _Run,
    _snapshot,
)

KINDS = [
    ("torch", "fp32", False),
    ("apex", "fp32", False),
    ("te", "fp8", True),
    ("te", "bf16", False),
    ("te", "fp16", True),
    ("te", "fp32", True),
]


class _Planted(RuntimeError):
    pass


def _fail_calls(opt, plan):
    """Make the inner step raise at call ``plan["at"]`` (counted in ``plan["calls"]``), before
    its update (``plan["when"] == "before"``) or after it (``"after"``)."""
    real = opt.step

    def step(*args, **kwargs):
        plan["calls"] += 1
        if plan["at"] == plan["calls"]:
            plan["at"] = None
            if plan["when"] == "before":
                raise _Planted("planted: no memory for the update's temporaries")
            real(*args, **kwargs)
            raise _Planted("planted: the update failed after writing")
        return real(*args, **kwargs)

    opt.step = step  # before the chunked update wraps it: it calls this one


class _CopyFailing:
    """Mixed into the checked device: the ``fail_at``-th copy after ``arm`` raises."""

    fail_at = None
    copies = 0

    def arm(self, fail_at):
        self.fail_at, self.copies = fail_at, 0

    def copy(self, dst, src):
        self.copies += 1
        if self.fail_at is not None and self.copies == self.fail_at:
            self.fail_at = None
            raise _Planted("planted copy failure")
        super().copy(dst, src)


def _device():
    from megatron_offload_testing import CheckedDevice

    return type("CopyFailingDevice", (_CopyFailing, CheckedDevice), {})()


def _scenario(kind, moments, remainders, *, warm, fail, undo=True):
    """Train ``warm`` steps, then a step where ``fail(run, plan)`` plants a failure; returns
    what the failed step changed and whether a retry (and one more step) equals a run that
    never failed."""
    params, opt = _build(kind, moments, remainders)
    ref_params, ref_opt = _build(kind, moments, remainders)
    plan = {"at": None, "when": None, "calls": 0}
    _fail_calls(opt, plan)
    need, planned = _per_param_need(opt, kind)
    run = _Run(
        opt, max(need, int(0.3 * sum(planned) * 2)), _kinds(kind), device=_device(), undo=undo
    )
    for step in range(warm):
        _grads(kind, params, step)
        _grads(kind, ref_params, step)
        run.step()
        ref_opt.step()
    _grads(kind, params, warm)
    _grads(kind, ref_params, warm)
    if warm:
        run.reload()
    before = _snapshot(opt)
    if warm:
        run.engine.offload(skip_unchanged=True)
        run.engine.release()
    plan["calls"] = 0
    fail(run, plan)
    error = notes = None
    try:
        run.step()
    except _Planted as exc:
        error, notes = str(exc), list(getattr(exc, "__notes__", []))
    calls, copies = plan["calls"], run.device.copies
    run.reload()
    after = _snapshot(opt)
    created = sum(1 for p in params if opt.state.get(p))
    run.engine.offload(skip_unchanged=True)
    run.engine.release()
    run.step()  # the same step again
    ref_opt.step()
    _grads(kind, params, warm + 1)
    _grads(kind, ref_params, warm + 1)
    run.step()
    ref_opt.step()
    run.reload()
    retried = _snapshot(opt) == _snapshot(ref_opt)
    run.close()
    return {
        "error": error,
        "notes": notes,
        "calls": calls,
        "chunks": run.engine.copies.last.update_chunks,
        "copies": copies,
        "changed": [repr(k) for k in before if before[k] != after.get(k)],
        "new_keys": [repr(k) for k in after if k not in before],
        "created": created,
        "retried": retried,
    }


def _at_call(at, when):
    def fail(run, plan):
        plan["at"], plan["when"] = at, when

    return fail


def run_failed_calls(kind, moments, remainders, undo):
    out = {}
    for when in ("before", "after"):
        out[when] = _scenario(kind, moments, remainders, warm=2, fail=_at_call(2, when), undo=undo)
    # The first step (states created one parameter per call): the third parameter fails.
    out["first"] = _scenario(
        kind, moments, remainders, warm=0, fail=_at_call(3, "after"), undo=undo
    )
    return out


@pytest.mark.parametrize("kind,moments,remainders", KINDS)
def test_a_call_failing_part_way_is_undone(isolated, kind, moments, remainders):
    out = isolated.run(run_failed_calls, kind, moments, remainders, True)
    for case, result in out.items():
        assert result["error"] is not None, case
        assert any("undone" in note for note in result["notes"]), (case, result["notes"])
        assert result["changed"] == [] and result["new_keys"] == [], (case, result["changed"][:5])
        assert result["retried"], case
    # The failure came after other calls had updated (and copied back) their parameters.
    assert out["before"]["calls"] == out["after"]["calls"] == 2 and out["before"]["chunks"] >= 2
    assert out["first"]["calls"] == 3 and out["first"]["created"] == 0


@pytest.mark.parametrize("kind,moments,remainders", [KINDS[0], KINDS[2]])
def test_without_the_undo_a_failed_call_leaves_the_step_half_done(
    isolated, kind, moments, remainders
):
    out = isolated.run(run_failed_calls, kind, moments, remainders, False)
    for case in ("before", "after"):
        assert out[case]["error"] is not None and out[case]["changed"], case
    assert out["first"]["created"] > 0  # the states of the first parameters stay


def run_every_copy_failing(kind, moments, remainders):
    # How many copies one step makes (H2D into the slots, the undo's copies, copy-backs).
    total = _scenario(
        kind, moments, remainders, warm=2, fail=lambda run, plan: run.device.arm(None)
    )["copies"]
    results = {}
    for at in range(1, total + 1):

        def fail(run, plan, at=at):
            run.device.arm(at)

        results[at] = _scenario(kind, moments, remainders, warm=2, fail=fail)
    return {"total": total, "results": results}


@pytest.mark.parametrize("kind,moments,remainders", [KINDS[0], KINDS[2]])
def test_every_copy_of_the_step_failing_in_turn_is_undone(isolated, kind, moments, remainders):
    out = isolated.run(run_every_copy_failing, kind, moments, remainders)
    assert out["total"] >= 6
    for at, result in out["results"].items():
        assert result["error"] == "planted copy failure", at
        assert result["changed"] == [] and result["new_keys"] == [], (at, result["changed"][:5])
        assert result["retried"], at


def run_without_ordering(label):
    from megatron_offload_testing import CheckedDevice, ProtocolViolation

    global _device
    make = _device
    _device = lambda: type("Unordered", (_CopyFailing, CheckedDevice), {})(skip_labels={label})  # noqa: E731
    try:
        result = _scenario("torch", "fp32", False, warm=2, fail=_at_call(2, "after"))
    except ProtocolViolation as violation:
        return {"violation": str(violation)}
    finally:
        _device = make
    return {"violation": None, "changed": result["changed"]}


@pytest.mark.parametrize("label", ["d2h-after-writers", "write-after-d2h"])
def test_the_undo_copies_are_ordered_around_the_update(isolated, label):
    # Without the wait before it, the copy may read the slot before its H2D landed (caught
    # by the model); without the wait after it, the update overwrites what it has not read
    # yet (the checked device runs side copies late, so the saved bytes are the new ones).
    out = isolated.run(run_without_ordering, label)
    assert out["violation"] is not None or out["changed"], out


def run_unknown_sizes():
    """An optimizer whose states cannot be sized before its first step (SGD's momentum: the
    planner's lower bound is 2 bytes per element, the buffer takes 4): the step finds a state
    too large for a slot only after creating earlier parameters' states."""
    import torch

    from megatron_offload.adapters import inner_optimizers
    from megatron_offload.engine import SlotSizeError

    def build():
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (8, 64, 12)]
        return params, torch.optim.SGD(params, lr=0.1, momentum=0.9)

    params, opt = build()
    ref_params, ref_opt = build()
    planned = inner_optimizers.planned_state_bytes(opt, params[1], moments=True, masters=False)
    run = _Run(opt, 2 * planned[0], ("optimizer_states",))  # fits the bound, not the buffer
    _grads("torch", params, 0)
    _grads("torch", ref_params, 0)
    before = _snapshot(opt)
    error = notes = None
    try:
        run.step()
    except SlotSizeError as exc:
        error, notes = str(exc), list(getattr(exc, "__notes__", []))
    after = _snapshot(opt)
    states = sum(1 for p in params if opt.state.get(p))
    run.close()
    retry = _Run(opt, 4 * 4 * 64, ("optimizer_states",))
    retry.step()
    ref_opt.step()
    retry.reload()
    equal = _snapshot(opt) == _snapshot(ref_opt)
    retry.close()
    return {
        "planned": planned,
        "error": error,
        "notes": notes,
        "states": states,
        "equal": equal,
        "changed": [repr(k) for k in before if before[k] != after.get(k)],
    }


def test_a_state_larger_than_planned_is_found_part_way_and_the_step_undone(isolated):
    out = isolated.run(run_unknown_sizes)
    assert out["planned"] == (2 * 64, False)  # a lower bound, said to be one
    assert out["error"] is not None and "did not tell before its first step" in out["error"]
    assert "do not retry" not in out["error"] and any("undone" in n for n in out["notes"])
    # The first parameter's state had been created and moved to the host: it is gone again.
    assert out["changed"] == [] and out["states"] == 0
    assert out["equal"]


def test_the_undo_buffer_counts_in_the_host_memory_budget():
    """Pinned at attach, inside ``host_memory_budget``: a budget without room for it is refused
    then, before any step, naming it; without the undo the same budget is enough."""
    import types

    import torch

    from megatron_offload.adapters import megatron_wrappers as adapter
    from megatron_offload.chunked.update import ChunkedUpdate
    from megatron_offload.engine import HostBudget, HostMemoryBudgetError, OffloadEngine
    from megatron_offload_testing import CheckedDevice

    def attach(limit, undo):
        params = [torch.nn.Parameter(torch.randn(n)) for n in (40, 24)]
        distrib = types.SimpleNamespace(optimizer=torch.optim.AdamW(params, lr=0.01))
        budget = HostBudget(limit)
        engine = OffloadEngine(
            CheckedDevice(),
            lambda: adapter.collect(distrib),
            streamed=lambda: adapter.in_state(distrib),
            budget=budget,
        )
        chunked = ChunkedUpdate(
            engine, distrib, total_bytes=1024, slots=2, kinds=("optimizer_states",), undo=undo
        )
        chunked.install()
        held = budget.held
        chunked.remove()
        return held, budget.held

    # States 2 x (160 + 96), parameters 160 + 96, room 2 x 128.
    need = 2 * 256 + 256 + 2 * 128
    assert attach(None, True) == (need, 0)  # held while attached, given back by remove()
    assert attach(need, True)[0] == need
    with pytest.raises(HostMemoryBudgetError, match="undo copies"):
        attach(need - 16, True)
    assert attach(need - 16, False) == (0, 0)


def run_undo_that_fails():
    """The step fails, and so does a copy of the undo: the error says the state may be partly
    updated, and names both failures."""
    from megatron_offload.engine import OffloadStateError

    outcome = {}

    def fail(run, plan):
        plan["at"], plan["when"] = 2, "after"
        device = run.device
        restore = run.chunked.undo.restore

        def failing_restore():
            device.arm(1)  # the undo's first copy back raises
            restore()

        run.chunked.undo.restore = failing_restore

    try:
        _scenario("torch", "fp32", False, warm=2, fail=fail)
    except OffloadStateError as error:
        outcome["error"] = str(error)
    return outcome


def test_an_undo_that_fails_says_the_state_may_be_partly_updated(isolated):
    out = isolated.run(run_undo_that_fails)
    message = out.get("error") or ""
    assert "could not be undone" in message and "Load the last checkpoint" in message, out
    assert (
        "planted: the update failed after writing" in message and "planted copy failure" in message
    )


def test_tensors_beside_the_device_are_saved_by_value():
    """On a GPU torch Adam keeps its step counts on the CPU: they are saved as host copies and
    written back on the host, not copied through the device."""
    import torch

    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine import OffloadEngine
    from megatron_offload.engine.undo import StepUndo

    class ElsewhereDevice(CPUDevice):
        def __init__(self):
            super().__init__()
            self.torch_device = torch.device("meta")  # every CPU tensor is beside this device

        def copy(self, dst, src):
            raise AssertionError("a tensor beside the device was copied through it")

    engine = OffloadEngine(ElsewhereDevice(), lambda: [])
    undo = StepUndo(engine)
    undo.begin()
    count = torch.tensor(3.0)
    undo.save([(count, count)])
    count += 1
    undo.restore()
    assert count.item() == 3.0 and undo.nbytes == 0


def run_modelled_step_time(undo):
    """A steady-state chunked step on the modelled device (copies at link speed, the update a
    modelled kernel proportional to its bytes): the modelled step time, and one chunk's undo
    copies' time."""
    import types

    import torch

    from megatron_offload.adapters import megatron_wrappers as adapter
    from megatron_offload.chunked.update import ChunkedUpdate
    from megatron_offload.engine import OffloadEngine
    from megatron_offload.phase import Phase
    from megatron_offload_testing import ModelledDevice

    bandwidth = 1e6  # bytes per second, both directions
    params = [
        torch.nn.Parameter(torch.randn(256, generator=torch.Generator().manual_seed(i)))
        for i in range(8)
    ]
    opt = torch.optim.AdamW(params, lr=0.01)
    distrib = types.SimpleNamespace(optimizer=opt)
    device = ModelledDevice(capacity=1 << 30, d2h_bandwidth=bandwidth, h2d_bandwidth=bandwidth)
    engine = OffloadEngine(
        device, lambda: adapter.collect(distrib), streamed=lambda: adapter.in_state(distrib)
    )
    slot = 2 * 2 * 256 * 4  # two parameters' moments per chunk
    chunked = ChunkedUpdate(
        engine, distrib, total_bytes=2 * slot, slots=2, kinds=("optimizer_states",), undo=undo
    )
    chunked.install()
    # The update kernel of a call: 3x the time its chunk's undo copies take (moments and
    # parameters of two parameters), so that they can hide behind the update before them.
    saved = slot + 2 * 256 * 4 + 2 * 16

    def kernel(inner, args, kwargs):
        device.model.compute(
            3
            * saved
            / bandwidth
            * sum(p.numel() for g in inner.param_groups for p in g["params"])
            / 512
        )

    opt.register_step_pre_hook(kernel)
    times = []
    for step in range(3):
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        device.synchronize()
        start = device.model.now
        token = chunked.phase.enter(Phase.STEPPING)
        try:
            opt.step()
        finally:
            chunked.phase.leave(token)
        device.synchronize()
        times.append(device.model.now - start)
        engine.offload(skip_unchanged=True)
        engine.release()
    engine.reload()
    engine.wait()
    chunks = engine.copies.last.update_chunks
    engine.close()
    chunked.remove()
    return {"step": times[-1], "chunks": chunks, "saved_copy": saved / bandwidth}


def test_the_undo_copies_overlap_the_update_of_the_chunk_before(isolated):
    off = isolated.run(run_modelled_step_time, False)
    on = isolated.run(run_modelled_step_time, True)
    assert off["chunks"] == on["chunks"] == 4
    # Issued with the prefetch, a chunk's undo copies run while the chunk before is updated:
    # only the first chunk's wait for them shows (saving each chunk just before its update
    # would add every chunk's, 4 x saved_copy).
    extra = on["step"] - off["step"]
    assert 0 < extra <= 1.01 * on["saved_copy"], (on, off)


def run_preparation_fails():
    """The undo's preparation (ordering the reload of what comes back whole) raises: nothing
    was updated, and the offloader is not left believing a chunked update still runs."""

    params, opt = _build("torch", "fp32", False)
    run = _Run(opt, 4096, _kinds("torch"))
    _grads("torch", params, 0)
    run.step()
    _grads("torch", params, 1)
    run.reload()
    before = _snapshot(opt)
    run.engine.offload(skip_unchanged=True)
    run.engine.release()
    wait = run.engine.wait

    def failing_wait(*args, **kwargs):
        raise _Planted("planted: the reload failed")

    run.engine.wait = failing_wait
    try:
        run.step()
    except _Planted as error:
        message = str(error)
    run.engine.wait = wait
    run.reload()
    unchanged = _snapshot(opt) == before
    run.close()
    return {"message": message, "phase": run.chunked.phase.current.value, "unchanged": unchanged}


def test_a_failure_before_the_first_call_leaves_no_update_running(isolated):
    out = isolated.run(run_preparation_fails)
    # The phase is back to where the step started: nothing believes the update still runs.
    assert out == {"message": "planted: the reload failed", "phase": "idle", "unchanged": True}


def test_neighbouring_tensors_of_one_storage_are_saved_with_one_copy():
    """Master weights consolidated in one of the engine's groups (16-byte aligned views of one
    storage) are saved with one copy per run of neighbours, not one per parameter; the bytes
    between them come back as they were."""
    import torch

    from megatron_offload.engine import OffloadEngine
    from megatron_offload.engine.undo import MERGE_GAP_BYTES, StepUndo, _coalesced
    from megatron_offload_testing import CheckedDevice

    flat = torch.arange(64, dtype=torch.float32)
    views = [flat[0:5], flat[8:20], flat[20:24]]  # gaps of 12 bytes and none
    far = flat[24 + MERGE_GAP_BYTES // 4 + 1 : 60]  # just beyond the gap merged over
    strided = flat[0:64:2]  # not contiguous: saved on its own
    other = torch.ones(7)
    cpu = torch.device("cpu")
    pairs = _coalesced([(t, t) for t in views + [far, strided, other]], cpu)
    ranges = sorted((p[1].start, p[1].end - p[1].start) for p in pairs if p[0].dtype == torch.uint8)
    assert ranges == [(0, 7 * 4), (0, 96), ((24 + MERGE_GAP_BYTES // 4 + 1) * 4, (60 - 41) * 4)]
    assert any(p[0] is strided for p in pairs) and len(pairs) == 4

    device = CheckedDevice()
    undo = StepUndo(OffloadEngine(device, lambda: []))
    undo.begin()
    before = flat.clone()
    undo.save([(t, t) for t in views + [far, strided]])
    for t in views + [far, strided]:  # the update writes them ...
        t.add_(1000)
    flat[5:8] = -1.0  # ... and the bytes between two of them, merged over
    undo.restore()
    assert torch.equal(flat, before)
    undo.close()
    device.check()
