"""The engine's copy protocol on the checked device, with negative controls.

A scenario drives the real ``OffloadEngine`` over a torch AdamW through every path of the
cycle and compares it bit for bit with the same optimizer run without offloading. On the
checked device side streams are deferred, so a missing wait shows: it either raises a
``ProtocolViolation`` where the mistake happens or lets poisoned memory into the results.
Each negative control drops exactly one labelled ordering call (``skip_labels``) and asserts
how it is caught.

Everything that drives the engine runs in the isolated process: a protocol bug can leave a
tensor released while torch touches it, which kills a CPU process outright.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

from megatron_offload.engine import OffloadEngine, labels
from megatron_offload_testing import CheckedDevice, ProtocolViolation
from megatron_offload_testing import checked_records as records
from tests.harness.adamw_model import AdamWModel
from tests.harness.checked import assert_dropped_call_caught

# Every label constant the engine passes to the device (upper-case names holding
# "words-like-this"), found by reading the module so a new label cannot go without a
# negative control (the slots' own label has its control in test_slots.py).
LABELS = sorted(
    value
    for name, value in vars(labels).items()
    if name.isupper()
    and isinstance(value, str)
    and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", value)
    and value != labels.SLOT_REUSE_AFTER_D2H
)


class Model(AdamWModel):
    """Parameters of several dtypes with an AdamW; gradients depend only on the step index."""

    SHAPES = (
        ((4, 3), torch.float32),
        ((7,), torch.float32),
        ((5,), torch.float64),
        ((6,), torch.bfloat16),
    )

    def __init__(self, seed: int = 0) -> None:
        super().__init__(self.SHAPES, seed)


def _outcome(device: CheckedDevice, raised: ProtocolViolation | None, **extra) -> dict:
    return {
        "raised": None if raised is None else (raised.rule, raised.kind),
        "violations": [(v.rule, v.kind) for v in device.violations],
        "calls": dict(device.calls),
        "skipped": dict(device.skipped),
        **extra,
    }


def _round_trip(engine) -> None:
    """Offload, release and reload: the copy back is issued, not waited for."""
    engine.offload()
    engine.release()
    engine.reload()


def run_cycles(skip_labels=(), raise_violations=True, max_piece_bytes=None) -> dict:
    """Offload/release/reload/wait cycles with steps, skipped steps, back-to-back calls and
    host reads; returns where the results differ from the run without offloading.

    With ``max_piece_bytes``, the groups are split into pieces and the full cycles release
    each piece right after its own copy (``offload(release=True)``)."""
    ref, off = Model(), Model()
    device = CheckedDevice(skip_labels=skip_labels, raise_violations=raise_violations)
    options = {} if max_piece_bytes is None else {"max_piece_bytes": max_piece_bytes}
    engine = OffloadEngine(device, off.collect, name="checked", **options)
    mismatches, host_mismatches, held, skipped_step_copies = [], [], [], None
    groups = []  # (kind, dtype) of every piece at the end

    def step(index):
        engine.mark_dirty()
        device.note_compute()  # the update reads and writes every tracked tensor
        off.step(index)
        ref.step(index)
        if not all(torch.equal(a, b) for a, b in zip(off.tensors(), ref.tensors())):
            mismatches.append(index)

    def full_cycle():
        if max_piece_bytes is None:
            engine.offload()
            engine.release()
        else:
            engine.offload(release=True)
        held.append(device.held_bytes)  # released memory queued D2Hs still read
        engine.reload()
        engine.wait()

    raised = None
    try:
        step(0)  # Adam creates its states: the first offload finds them with the parameters
        full_cycle()  # first cycle: per-tensor copies, then consolidation at the reload
        step(1)
        full_cycle()  # consolidated groups: one copy per group and direction
        step(2)

        # The host copy is read by the host (a checkpoint would do this).
        engine.offload()
        engine.synchronize_host()
        for group in engine.pieces:
            device.check_readable(group.host)
            if not all(torch.equal(host, t) for t, host in group.host_slices()):
                host_mismatches.append(group.kind)
        engine.release()
        engine.reload()
        engine.wait()
        step(3)

        # A skipped step: nothing changed, so the second offload copies nothing (rule 6).
        full_cycle()
        engine.offload(skip_unchanged=True)
        skipped_step_copies = engine.stats()["d2h_copies"]
        engine.release()
        engine.reload()
        engine.wait()
        step(4)

        # Back to back without a step: offload then reload with the memory still there;
        # offload again; reload then offload before anything waited for the copy-back.
        engine.offload()
        engine.reload()
        _round_trip(engine)
        _round_trip(engine)
        engine.wait()
        step(5)

        full_cycle()
        if not all(torch.equal(a, b) for a, b in zip(off.tensors(), ref.tensors())):
            mismatches.append("final")
        groups.extend((g.kind, g.dtype) for g in engine.pieces)
        engine.close()  # detach: the host arena is given back
        device.check(raise_on_violation=raise_violations)
    except ProtocolViolation as exc:
        raised = exc
    return _outcome(
        device,
        raised,
        mismatches=mismatches,
        host_mismatches=host_mismatches,
        held_after_release=held,
        skipped_step_copies=skipped_step_copies,
        pieces=len(groups),
        groups=len(set(groups)),
    )


def run_dropped_prefetch(skip_labels=()) -> dict:
    """A copy-back is issued and the optimizer is dropped before anything waited for it.

    The regrown memory dies with the engine while the H2D may still write it: the engine's
    finalizer waits for its copies before anything it owns is freed. The host copy is kept
    alive here so that only the device side is in question.
    """

    def body(off, device, engine):
        off.step(0)
        _round_trip(engine)
        return [group.host for group in engine.pieces]

    return _scenario(body, skip_labels, after_drop=lambda device: device.synchronize())


def _scenario(body, skip_labels=(), after_drop=None) -> dict:
    """``body(model, device, engine)`` on a fresh model, checked device and engine; a protocol
    violation it raises ends it and is part of the outcome. With ``after_drop(device)``, the
    model and the engine are then dropped (a training job replaced mid-run) and ``after_drop``
    runs once they are collected; what ``body`` returns is kept alive until then."""
    off = Model()
    device = CheckedDevice(skip_labels=skip_labels)
    engine = OffloadEngine(device, off.collect, name="checked")
    raised = None
    try:
        kept = body(off, device, engine)
        if after_drop is not None:
            del engine, off
            gc.collect()
            after_drop(device)
        del kept
    except ProtocolViolation as exc:
        raised = exc
    return _outcome(device, raised)


def run_rebuild_after_reload(skip_labels=()) -> dict:
    """States appear after a cycle (Adam's first step comes after the first offload): the
    engine lays the groups out again and gives back the old host arena."""

    def body(off, device, engine):
        _round_trip(engine)
        engine.wait()
        device.note_compute()
        off.step(0)
        _round_trip(engine)  # new tensors: the layout is rebuilt and the old arena freed
        engine.wait()

    return _scenario(body, skip_labels)


def run_close_after_reload(skip_labels=()) -> dict:
    """Detach right after a copy-back: close() gives back the host arena."""

    def body(off, device, engine):
        off.step(0)
        _round_trip(engine)
        engine.close()

    return _scenario(body, skip_labels)


def run_step_after_unreleased_offload(skip_labels=()) -> dict:
    """offload() then reload() without release(): the memory never left, and a step follows."""

    def body(off, device, engine):
        off.step(0)
        engine.offload()
        engine.reload()
        engine.wait()
        engine.mark_dirty()
        device.note_compute()
        off.step(1)

    return _scenario(body, skip_labels)


# --------------------------------------------------------------------- tests
def test_every_engine_label_is_known():
    assert LABELS, "no label constants found in engine.py"
    from .test_any_stream import ANY_STREAM_CONTROLS  # the labels a second stream needs

    controlled = set(CAUGHT_BY) | set(CAUGHT_ONLY_WHEN_DROPPED) | set(ANY_STREAM_CONTROLS)
    assert set(LABELS) == controlled, f"labels without a control: {set(LABELS) - controlled}"


def test_full_protocol_is_clean_and_bitwise(isolated):
    out = isolated.run(run_cycles)
    assert out["raised"] is None, out
    assert out["violations"] == []
    assert out["mismatches"] == [] and out["host_mismatches"] == []
    assert out["skipped_step_copies"] == 0  # the skipped step left the host copy valid
    # The D2Hs were still queued at release(): the deferred free (record_stream) was used.
    assert out["held_after_release"][0] > 0
    from .test_any_stream import ANY_STREAM_CONTROLS  # issued only with a second stream

    for label in set(LABELS) - set(ANY_STREAM_CONTROLS):
        assert out["calls"].get(label, 0) > 0, f"the scenario never issues '{label}'"
    assert out["skipped"] == {}


# label -> (rule, kind) of the ProtocolViolation raised when that call is dropped, and
# whether the same run without raising also corrupts the results (poison reaches the
# optimizer or the host read).
CAUGHT_BY = {
    labels.D2H_AFTER_WRITERS: ((1, records.UNORDERED_DEVICE_ACCESS), False),
    labels.D2H_RECORD_STREAM: ((2, records.RELEASE_IN_USE), True),
    labels.H2D_AFTER_ALLOCATION: ((7, records.WRITE_BEFORE_ALLOCATION), False),
    labels.H2D_AFTER_D2H: ((5, records.UNORDERED_HOST_READ), True),
    labels.USE_AFTER_H2D: ((4, records.USE_BEFORE_COPY), True),
    labels.HOST_READ_AFTER_D2H: ((5, records.UNORDERED_HOST_READ), True),
    labels.HOST_FREE_AFTER_COPIES: ((5, records.HOST_FREED_IN_USE), False),
}
# Labels whose call matters only on a path the main scenario does not need: each has its own
# scenario, clean with the call and caught without it.
CAUGHT_ONLY_WHEN_DROPPED = {
    labels.WRITE_AFTER_D2H: (run_step_after_unreleased_offload, (2, records.OVERWRITE_WHILE_READ)),
}


@pytest.mark.parametrize("label", sorted(CAUGHT_BY))
def test_dropped_ordering_call_is_caught(isolated, label):
    caught, corrupts = CAUGHT_BY[label]
    assert_dropped_call_caught(isolated, run_cycles, label, caught)

    data = isolated.run(run_cycles, skip_labels=(label,), raise_violations=False)
    assert caught in data["violations"]
    corrupted = bool(data["mismatches"] or data["host_mismatches"])
    # On the CPU the compute stream runs eagerly, so a missing wait *for* the compute
    # stream cannot change data here; every other missing call lets poison through.
    assert corrupted == corrupts, data


PIECE_BYTES = 64  # a piece per tensor or two: every group of the model is split


def test_full_protocol_in_pieces_is_clean_and_bitwise(isolated):
    out = isolated.run(run_cycles, max_piece_bytes=PIECE_BYTES)
    assert out["raised"] is None, out
    assert out["violations"] == []
    assert out["mismatches"] == [] and out["host_mismatches"] == []
    assert out["skipped_step_copies"] == 0
    assert out["held_after_release"][0] > 0  # pieces released while their D2Hs were queued
    assert out["pieces"] > out["groups"] > 0  # the groups really were split


@pytest.mark.parametrize("label", sorted(CAUGHT_BY))
def test_dropped_ordering_call_is_caught_in_pieces(isolated, label):
    """The same negative controls with pieces released one by one after their copies."""
    caught, _ = CAUGHT_BY[label]
    assert_dropped_call_caught(isolated, run_cycles, label, caught, max_piece_bytes=PIECE_BYTES)


@pytest.mark.parametrize("label", sorted(CAUGHT_ONLY_WHEN_DROPPED))
def test_ordering_call_needed_on_a_side_path_is_caught(isolated, label):
    scenario, caught = CAUGHT_ONLY_WHEN_DROPPED[label]
    clean = isolated.run(scenario)
    assert clean["raised"] is None and clean["violations"] == [], clean
    assert clean["calls"].get(label, 0) > 0
    assert_dropped_call_caught(isolated, scenario, label, caught)


def run_engine_dropped_with_copies_in_flight(skip_labels=()) -> dict:
    """The optimizer and its engine are dropped right after an offload (a training job
    replaced mid-run): the D2H into the host arena is still queued when the arena dies."""

    def body(off, device, engine):
        off.step(0)
        engine.offload()
        engine.release()

    return _scenario(body, skip_labels, after_drop=lambda device: device.check())


@pytest.mark.parametrize(
    "scenario,caught",
    [
        (run_rebuild_after_reload, (5, records.HOST_FREED_IN_USE)),
        (run_close_after_reload, (5, records.HOST_FREED_IN_USE)),
        (run_engine_dropped_with_copies_in_flight, (5, records.HOST_FREED_IN_USE)),
        # The regrown device memory dies with the engine while the H2D may still write it:
        # the finalizer's host wait is what keeps that safe.
        (run_dropped_prefetch, (2, records.FREED_IN_USE)),
    ],
)
def test_host_arena_is_freed_only_after_its_copies(isolated, scenario, caught):
    clean = isolated.run(scenario)
    assert clean["raised"] is None and clean["violations"] == [], clean
    label = labels.HOST_FREE_AFTER_COPIES
    dropped = isolated.run(scenario, skip_labels=(label,))
    assert dropped["raised"] == caught, dropped
