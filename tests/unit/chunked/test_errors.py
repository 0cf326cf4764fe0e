"""Error paths of the chunked update: a copy that raises half-way, on the checked device.

A device whose N-th copy raises (after some copies of the same batch were queued) stands for
a failing copy launch. Whatever was queued before the failure still runs on its side
stream, so the memory it touches must stay alive and be ordered before its next user:

* a slot fetch (H2D into a device slot, ``engine/slots.py``): the slot is freed at the end
  of the run, so the fetch's event must be recorded (and waited for) even when a copy of it
  raised;
* a slot's copy-back (D2H into the host copies): the next reader of the host copies (the
  reload) must wait for the copies queued before the failure;
* the first step's new states (D2H into fresh host buffers, ``integration/chunked.py``):
  the buffers go back, and the states are written again, only after those copies ran.

On the checked device (side-stream copies deferred until something orders them) each of
these is a protocol violation without the fix. Scenarios run in the isolated process.
"""

from __future__ import annotations

import types

import pytest

from megatron_offload.adapters import megatron_wrappers as adapter
from megatron_offload.chunked.update import ChunkedUpdate
from megatron_offload.engine import OffloadEngine
from megatron_offload.phase import Phase
from megatron_offload_testing import CheckedDevice, ProtocolViolation
from tests.harness.adamw_model import seeded_grads, two_group_adamw

STATES = "optimizer_states"


class FailingDevice(CheckedDevice):
    """A checked device whose ``fail_at``-th copy after ``arm()`` raises."""

    def __init__(self, **kwargs) -> None:
        super().__init__(raise_violations=False, **kwargs)
        self.fail_at = None
        self.copies = 0

    def arm(self, fail_at: int) -> None:
        self.fail_at, self.copies = fail_at, 0

    def copy(self, dst, src) -> None:
        if self.fail_at is not None:
            self.copies += 1
            if self.copies == self.fail_at:
                self.fail_at = None
                raise RuntimeError("planted copy failure")
        super().copy(dst, src)


def run_failing_copy(fail_in: str, fail_at: int) -> dict:
    """Train with the chunked update; make the ``fail_at``-th copy of one step raise.

    ``fail_in``: "creation" (the first step, whose new states go to the host buffer by
    buffer), "stream" (a later step, whose states stream through the slots).
    """
    params, opt = two_group_adamw((40, 7, 33, 16, 5, 24))
    distrib = types.SimpleNamespace(optimizer=opt)
    device = FailingDevice()
    engine = OffloadEngine(
        device, lambda: adapter.collect(distrib), streamed=lambda: adapter.in_state(distrib)
    )
    chunked = ChunkedUpdate(engine, distrib, total_bytes=2 * 512, slots=2, kinds=(STATES,))
    chunked.install()
    error = None
    for step in range(3):
        seeded_grads(params, step)
        if fail_in == ("creation" if step == 0 else "stream" if step == 2 else None):
            device.arm(fail_at)
        token = chunked.phase.enter(Phase.STEPPING)
        try:
            opt.step()
        except RuntimeError as exc:
            error = str(exc)
            if fail_in == "creation":
                # The states made so far stay on the device, in the optimizer: whatever runs
                # next (a retried step) writes them.
                device.note_compute()
        finally:
            chunked.phase.leave(token)
        engine.offload(skip_unchanged=True)
        engine.release()
    engine.reload()
    engine.wait()
    readable = True
    for _, tensor in adapter.collect(distrib):
        device.check_readable(tensor)
    try:
        engine.close()
        chunked.remove()
        device.check(raise_on_violation=False)
    except ProtocolViolation:  # pragma: no cover - raise_violations=False collects them
        readable = False
    return {
        "error": error,
        "readable": readable,
        "violations": [(v.rule, v.kind, v.message) for v in device.violations],
    }


# The streamed step's copies (slots of 512 bytes; fp32 and fp64 parameters, two groups):
# chunk 0 = parameters 0 and 1 (two segments), chunk 1 = parameter 2 (one), chunk 2 =
# parameters 3 and 4 (two), chunk 3 = parameter 5. In order: fetch 0 (#1, #2), fetch 1 (#3),
# copy-back 0 (#4, #5), fetch 2 (#6, #7), copy-back 1 (#8), ...


@pytest.mark.parametrize("fail_at", [2, 7], ids=["first-fetch", "later-fetch"])
def test_a_slot_fetch_that_raises_half_way_orders_its_queued_copies(isolated, fail_at):
    # The fetch's first segment is queued when its second raises. Without its event the slot
    # is freed with that H2D still writing it (rule 2, freed-in-use).
    out = isolated.run(run_failing_copy, "stream", fail_at)
    assert out["error"] == "planted copy failure"
    assert out["violations"] == [], out["violations"]


def test_a_slot_copy_back_that_raises_half_way_is_waited_for_by_the_reload(isolated):
    # Copy-back 0's first segment is queued when its second (#5) raises. Without its event the
    # reload's H2D, and the host freeing the arena, do not wait for it (rule 5).
    out = isolated.run(run_failing_copy, "stream", 5)
    assert out["error"] == "planted copy failure"
    assert out["violations"] == [], out["violations"]


def test_new_states_whose_copy_to_the_host_raises_half_way_stay_consistent(isolated):
    # The first step: the first parameter's exp_avg goes to a host buffer, its exp_avg_sq
    # raises. Without waiting for that copy, its buffer is dropped while it writes it (rule
    # 5) and the states it reads are written again (rule 2, overwrite-while-read).
    out = isolated.run(run_failing_copy, "creation", 2)
    assert out["error"] == "planted copy failure"
    assert out["violations"] == [], out["violations"]
