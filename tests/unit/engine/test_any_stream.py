"""The engine when the caller's current stream changes between calls (any-stream safety).

The step runs on the stream current at ``wait`` (its pre-hook), which need not be the one
current at ``reload`` (a prefetch from a backward hook runs on autograd's stream) or at
``offload`` (a user's ``torch.cuda.stream`` block around the step, an RL loop). The checked
device gets a second compute stream; every scenario is compared bit for bit with the same
AdamW run without offloading, and each ordering call the second stream needs has its
negative control. Engines run in the isolated process (a released tensor touched by mistake
kills a CPU process).
"""

from __future__ import annotations

import pytest
import torch

from megatron_offload.engine import OffloadEngine, labels
from megatron_offload_testing import (
    OVERWRITE_WHILE_READ,
    RELEASE_IN_USE,
    UNORDERED_DEVICE_ACCESS,
    CheckedDevice,
    ProtocolViolation,
)
from tests.harness.checked import assert_dropped_call_caught

from .test_protocol_controls import PIECE_BYTES, Model, _outcome


def run_two_streams(skip_labels=(), raise_violations=True) -> dict:
    """Steps on one compute stream, offloads and reloads on another, and the reverse."""
    ref, off = Model(), Model()
    device = CheckedDevice(skip_labels=skip_labels, raise_violations=raise_violations)
    engine = OffloadEngine(device, off.collect, name="checked", max_piece_bytes=PIECE_BYTES)
    default = device.current_stream()
    other = device.compute_stream()
    mismatches = []

    def step_on(stream, index):
        with device.use_stream(stream):
            engine.wait()  # the step's pre-hook, on the step's stream
            engine.mark_dirty()
            device.note_compute()  # the update reads and writes every state
            off.step(index)
            ref.step(index)
        if not all(torch.equal(a, b) for a, b in zip(off.tensors(), ref.tensors())):
            mismatches.append(index)

    raised = None
    try:
        # Adam makes its states on `other` (their home stream: every regrowth happens there);
        # the offload after the step runs on `default`.
        step_on(other, 0)
        engine.offload(release=True)
        # Reloaded from `default` (a prefetch), used by the step on `other`.
        engine.reload()
        step_on(other, 1)
        engine.offload(release=True)
        # A read-only use on `other` (a checkpoint save), then a release without a copy:
        # the host copy is still valid, so only the allocator protects `other`'s reads.
        engine.reload()
        with device.use_stream(other):
            engine.wait()
            device.note_compute(writes=False)
        engine.offload(skip_unchanged=True, release=True)
        # Kept in place: the D2H is still queued when `default` reloads, and `other` writes.
        engine.reload()
        step_on(other, 2)
        engine.offload()
        engine.reload()
        step_on(other, 3)
        # The reverse: a step on `default`, offloaded and reloaded on `other`.
        engine.offload(release=True)
        engine.reload()
        step_on(default, 4)
        with device.use_stream(other):
            engine.offload(release=True)
            engine.reload()
        step_on(default, 5)
        engine.offload(release=True)
        # Regrown on `other`, the home stream (rule 7), then read on `default` alone and
        # released without a copy: only the allocator protects `default`'s reads.
        engine.reload()
        engine.wait()
        device.note_compute(writes=False)
        engine.offload(skip_unchanged=True, release=True)
        engine.reload()
        engine.wait()
        engine.close()
        device.check(raise_on_violation=raise_violations)
    except ProtocolViolation as exc:
        raised = exc
    return _outcome(device, raised, mismatches=mismatches)


# label -> (rule, kind) raised when that call is dropped in ``run_two_streams``.
ANY_STREAM_CONTROLS = {
    labels.D2H_AFTER_USERS: (1, UNORDERED_DEVICE_ACCESS),
    labels.USE_RECORD_STREAM: (2, RELEASE_IN_USE),
    labels.USER_AFTER_D2H: (2, OVERWRITE_WHILE_READ),
}


def test_two_compute_streams_are_clean_and_bitwise(isolated):
    out = isolated.run(run_two_streams)
    assert out["raised"] is None and out["violations"] == [], out
    assert out["mismatches"] == []
    for label in ANY_STREAM_CONTROLS:
        assert out["calls"].get(label, 0) > 0, f"the scenario never issues '{label}'"


@pytest.mark.parametrize("label", sorted(ANY_STREAM_CONTROLS))
def test_dropped_call_for_another_stream_is_caught(isolated, label):
    assert_dropped_call_caught(isolated, run_two_streams, label, ANY_STREAM_CONTROLS[label])


def test_one_stream_issues_none_of_the_calls_for_another(isolated):
    """With a single stream nothing extra is issued: the cost is only on the other path."""
    from .test_protocol_controls import run_cycles

    out = isolated.run(run_cycles, max_piece_bytes=PIECE_BYTES)
    assert out["raised"] is None, out
    for label in ANY_STREAM_CONTROLS:
        assert out["calls"].get(label, 0) == 0, (label, out["calls"])
