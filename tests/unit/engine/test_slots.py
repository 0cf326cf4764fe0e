"""Streaming released tensors through device slots (``engine/slots.py``), on the checked device.

A scenario offloads an AdamW's states, then runs updates chunk by chunk with the states in
slots and compares with the same AdamW stepped whole, bit for bit. On the checked device the
copies of the slots are deferred, so a missing wait raises where it happens or lets poison
(fresh slot memory) into the results. Each negative control drops one labelled ordering call.
Scenarios run in the isolated process (a protocol bug can leave torch touching released
memory, which kills a CPU process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload.engine import OffloadEngine, OffloadStateError, labels
from megatron_offload.engine.slots import SlotSizeError, SlotStream
from megatron_offload_testing import (
    DEVICE_RACE,
    UNORDERED_DEVICE_ACCESS,
    UNORDERED_HOST_READ,
    WRITE_BEFORE_ALLOCATION,
    CheckedDevice,
    ProtocolViolation,
)
from tests.harness.checked import assert_dropped_call_caught

STATES = "optimizer_states"


class Model:
    """AdamW over parameters of two dtypes (two groups); gradients depend on the step only."""

    def __init__(self, sizes=(40, 7, 33, 16, 5, 24), seed=0):
        gen = torch.Generator().manual_seed(seed)
        dtypes = (torch.float32, torch.float64)
        self.params = [
            torch.nn.Parameter(torch.randn(n, generator=gen).to(dtypes[i % 2]))
            for i, n in enumerate(sizes)
        ]
        self.opt = torch.optim.AdamW(self.params, lr=0.01, weight_decay=0.1)

    def collect(self):
        for p in self.params:
            for key in ("exp_avg", "exp_avg_sq"):
                if key in self.opt.state.get(p, {}):
                    yield STATES, self.opt.state[p][key]

    def grads(self, step):
        for j, p in enumerate(self.params):
            gen = torch.Generator().manual_seed(100 * step + j)
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)

    def states(self):
        return [t for _, t in self.collect()]


def _chunked_step(model, engine, stream, device):
    """One AdamW step with the states streamed: per chunk, swap the state entries for the
    slot views, step only the chunk's parameters, swap back."""
    units = [
        [model.opt.state[p]["exp_avg"], model.opt.state[p]["exp_avg_sq"]] for p in model.params
    ]
    chunks = stream.plan(units)

    def update(chunk, views):
        params = [model.params[i] for i in chunk.units]
        saved = {}
        for p in params:
            saved[p] = dict(model.opt.state[p])
            for key in ("exp_avg", "exp_avg_sq"):
                model.opt.state[p][key] = views[id(saved[p][key])]
        group = model.opt.param_groups[0]
        everything = group["params"]
        group["params"] = params
        try:
            model.opt.step()
        finally:
            group["params"] = everything
            for p in params:
                for key in ("exp_avg", "exp_avg_sq"):
                    model.opt.state[p][key] = saved[p][key]

    stream.run(chunks, update)
    return chunks


def run_stream(
    skip_labels=(),
    raise_violations=True,
    *,
    sizes=(40, 7, 33, 16, 5, 24),
    slot_bytes=512,
    slots=2,
    steps=3,
    fail_at_chunk=None,
) -> dict:
    ref, off = Model(sizes), Model(sizes)
    device = CheckedDevice(skip_labels=skip_labels, raise_violations=raise_violations)
    engine = OffloadEngine(device, off.collect, name="checked", streamed=off.states)
    stream = SlotStream(engine, slot_bytes=slot_bytes, slots=slots)
    raised, error, mismatches, figures = None, None, [], []
    try:
        for model in (ref, off):  # the first step creates the states (Adam does it lazily)
            model.grads(0)
            model.opt.step()
        engine.offload()
        engine.release()
        for step in range(1, steps):
            ref.grads(step)
            ref.opt.step()
            off.grads(step)
            if fail_at_chunk is not None:
                original = off.opt.step
                calls = []

                def failing(*a, **k):
                    calls.append(1)
                    if len(calls) > fail_at_chunk:
                        raise RuntimeError("planted failure in the update")
                    return original(*a, **k)

                off.opt.step = failing
            try:
                chunks = _chunked_step(off, engine, stream, device)
            except RuntimeError as exc:
                error = str(exc)
                chunks = []
            finally:
                off.opt.__dict__.pop("step", None)
            stats = engine.stats()
            figures.append(
                {
                    "chunks": len(chunks),
                    "stats_chunks": stats["update_chunks"],
                    "copies": stats["update_copies"],
                    "released": engine.is_released(),
                    "slot_peak": stream.peak_slot_bytes,
                    "largest_chunk": max((c.nbytes for c in chunks), default=0),
                }
            )
        engine.reload()
        engine.wait()
        states_equal = [torch.equal(a, b) for a, b in zip(off.states(), ref.states())]
        params_equal = [torch.equal(a, b) for a, b in zip(off.params, ref.params)]
        if not all(states_equal) or not all(params_equal):
            mismatches = [i for i, ok in enumerate(states_equal) if not ok]
            mismatches += [f"param{i}" for i, ok in enumerate(params_equal) if not ok]
        engine.close()
        device.check(raise_on_violation=raise_violations)
    except ProtocolViolation as exc:
        raised = exc
    return {
        "raised": None if raised is None else (raised.rule, raised.kind),
        "violations": [(v.rule, v.kind) for v in device.violations],
        "calls": dict(device.calls),
        "skipped": dict(device.skipped),
        "mismatches": mismatches,
        "figures": figures,
        "error": error,
        "states_equal": states_equal if raised is None else None,
    }


LABELS = (
    labels.H2D_AFTER_ALLOCATION,
    labels.H2D_AFTER_D2H,
    labels.SLOT_REUSE_AFTER_D2H,
    labels.USE_AFTER_H2D,
    labels.D2H_AFTER_WRITERS,
    labels.D2H_RECORD_STREAM,
)


def test_streamed_updates_are_bitwise_and_clean(isolated):
    out = isolated.run(run_stream)
    assert out["raised"] is None and out["violations"] == [], out
    assert out["mismatches"] == []
    for figures in out["figures"]:
        assert figures["chunks"] == figures["stats_chunks"] >= 3
        # One copy per group and direction per chunk at most (two dtypes: two groups).
        assert figures["copies"] <= 2 * 2 * figures["chunks"]
        assert figures["released"]  # the states never came back whole
        assert figures["largest_chunk"] <= 512 and figures["slot_peak"] <= 2 * 512
    for label in LABELS:
        assert out["calls"].get(label, 0) > 0, f"the scenario never issues '{label}'"


def test_copies_per_chunk_do_not_grow_with_the_parameter_count(isolated):
    """The same bytes in 10x more parameters: the same chunks and copies (neighbouring
    states of a chunk move as one segment)."""
    few = isolated.run(run_stream, sizes=(96,) * 8, slot_bytes=4096, steps=2)
    many = isolated.run(run_stream, sizes=(8,) * 96, slot_bytes=4096, steps=2)
    assert few["mismatches"] == many["mismatches"] == []
    assert few["figures"][0]["chunks"] == many["figures"][0]["chunks"] >= 2
    assert few["figures"][0]["copies"] == many["figures"][0]["copies"]


def test_one_slot_works_without_overlap(isolated):
    out = isolated.run(run_stream, slots=1, slot_bytes=700)
    assert out["raised"] is None and out["mismatches"] == []
    assert all(f["slot_peak"] <= 700 for f in out["figures"])


# label -> (rule, kind) raised when that call is dropped.
CAUGHT_BY = {
    labels.H2D_AFTER_ALLOCATION: (7, WRITE_BEFORE_ALLOCATION),
    labels.H2D_AFTER_D2H: (5, UNORDERED_HOST_READ),
    labels.SLOT_REUSE_AFTER_D2H: (3, DEVICE_RACE),
    labels.USE_AFTER_H2D: (3, DEVICE_RACE),  # the D2H reads what the H2D still writes
    labels.D2H_AFTER_WRITERS: (1, UNORDERED_DEVICE_ACCESS),
}


@pytest.mark.parametrize("label", sorted(CAUGHT_BY))
def test_dropped_ordering_call_is_caught(isolated, label):
    assert_dropped_call_caught(isolated, run_stream, label, CAUGHT_BY[label])


def test_dropped_record_stream_lets_poison_into_the_host_copy(isolated):
    """Without record_stream the slots die with their D2H still queued: the copies read
    freed memory (the model writes poison), so the states come back wrong."""
    out = isolated.run(run_stream, skip_labels=(labels.D2H_RECORD_STREAM,), raise_violations=False)
    assert out["skipped"].get(labels.D2H_RECORD_STREAM, 0) > 0
    assert out["violations"] and out["mismatches"]


def test_use_before_h2d_reads_poison_when_not_raising(isolated):
    """The update runs on a slot its H2D has not filled: it reads the slot's poison."""
    out = isolated.run(run_stream, skip_labels=(labels.USE_AFTER_H2D,), raise_violations=False)
    assert (3, DEVICE_RACE) in out["violations"]
    assert out["mismatches"]


def run_failing_update():
    return run_stream(steps=2, fail_at_chunk=1)


def test_an_update_that_raises_leaves_the_states_consistent(isolated):
    """The first chunk is updated and copied back, the second raises: the optimizer's state
    entries are the tracked tensors again, nothing races, and the chunks never updated keep
    their previous values (the reference stepped everything, so they differ)."""
    out = isolated.run(run_failing_update)
    assert out["raised"] is None and out["violations"] == [], out
    assert out["error"] == "planted failure in the update"
    equal = out["states_equal"]
    assert equal[:2] == [True, True]  # the first chunk's parameter: updated and copied back
    assert not all(equal)  # later chunks: not updated


def run_plan_errors():
    model = Model((40, 300))
    device = CheckedDevice()
    model.grads(0)
    model.opt.step()
    engine = OffloadEngine(device, model.collect, name="checked", streamed=model.states)
    stream = SlotStream(engine, slot_bytes=1024)
    out = {}
    units = [
        [model.opt.state[p]["exp_avg"], model.opt.state[p]["exp_avg_sq"]] for p in model.params
    ]
    engine.offload()
    try:
        stream.run(stream.plan(units[:1]), lambda chunk, views: None)
    except OffloadStateError as exc:
        out["not_released"] = str(exc)
    engine.release()
    try:
        stream.plan([[torch.zeros(3)]])
    except OffloadStateError as exc:
        out["untracked"] = str(exc)
    allocated = device.device_bytes()
    try:
        stream.plan(units, names=["small", "the big one"])
    except SlotSizeError as exc:
        out["too_big"] = str(exc)
    out["allocated_by_plan"] = device.device_bytes() - allocated
    try:
        SlotStream(engine, slot_bytes=0)
    except ValueError as exc:
        out["zero"] = str(exc)
    engine.reload()
    engine.wait()
    engine.close()
    device.check()
    return out


def test_plan_and_run_refuse_what_they_cannot_do(isolated):
    out = isolated.run(run_plan_errors)
    assert "streams released states only" in out["not_released"]
    assert "a streamed tensor is not tracked" in out["untracked"]
    # 300 fp64 elements, two moments: 4,800 bytes; two slots need twice that.
    assert "the big one" in out["too_big"] and "4,800 bytes" in out["too_big"]
    assert "at least 9,600 bytes" in out["too_big"] and "chunked_update_bytes" in out["too_big"]
    assert out["allocated_by_plan"] == 0  # refused before any memory was touched
    assert "slot_bytes must be > 0" in out["zero"]
