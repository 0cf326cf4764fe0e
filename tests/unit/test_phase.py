"""The phase tracker (phase.py): a stack of phases, with no consequence of its own."""

from __future__ import annotations

import pytest

from megatron_offload.phase import Phase, PhaseTracker


def test_phases_nest_and_each_block_gives_back_the_phase_before_it():
    tracker = PhaseTracker()
    assert tracker.current is Phase.IDLE and not tracker.serving
    with tracker.within(Phase.STEPPING):
        token = tracker.enter(Phase.MOVING)
        assert tracker.current is Phase.MOVING
        tracker.leave(token)
        assert tracker.current is Phase.STEPPING
        with tracker.within(Phase.SERVING):
            with tracker.within(Phase.MOVING):
                assert tracker.serving  # anywhere inside a host view
        assert not tracker.serving
    assert tracker.current is Phase.IDLE


def test_leaving_a_token_closes_every_phase_entered_after_it_even_on_an_error():
    tracker = PhaseTracker()
    outer = tracker.enter(Phase.STEPPING)
    tracker.enter(Phase.STREAMING)
    tracker.enter(Phase.MOVING)  # never left by its own code (an error in between)
    tracker.leave(outer)
    assert tracker.current is Phase.IDLE
    with pytest.raises(RuntimeError):
        with tracker.within(Phase.MOVING):
            raise RuntimeError("a failed move")
    assert tracker.current is Phase.IDLE
    tracker.leave(0)  # the bottom is never left
    assert tracker.current is Phase.IDLE


def test_once_detached_nothing_enters_and_nothing_leaves():
    tracker = PhaseTracker()
    token = tracker.enter(Phase.MOVING)
    tracker.detached()  # detach() inside a block (a hook that detaches)
    tracker.leave(token)
    assert tracker.current is Phase.DETACHED
    with tracker.within(Phase.STEPPING):
        assert tracker.current is Phase.DETACHED
    assert tracker.current is Phase.DETACHED
