"""The allocator model, rule by rule, each against a negative control (pure Python)."""

from __future__ import annotations

import pytest

from megatron_offload_testing.allocator_model import (
    AllocatorModel,
    MiB,
    ModelledOutOfMemory,
    round_size,
    segment_size,
)

D2H, H2D = 1e9, 2e9  # bytes per second


def model(capacity=1 << 30, **kwargs):
    return AllocatorModel(capacity=capacity, d2h_bandwidth=D2H, h2d_bandwidth=H2D, **kwargs)


def offload_copy(m, block, side, nbytes=None):
    """A D2H of ``block`` on ``side``, issued now; returns its end time."""
    return m.copy(side, block.size if nbytes is None else nbytes, "d2h", uses=[block])


# ------------------------------------------------------------ sizes and segments
@pytest.mark.parametrize(
    "nbytes, rounded", [(1, 512), (512, 512), (513, 1024), (3 * MiB + 1, 3 * MiB + 512)]
)
def test_requests_round_up_to_512_bytes(nbytes, rounded):
    m = model()
    assert round_size(nbytes) == rounded
    assert m.malloc(nbytes).size == rounded
    assert m.allocated_bytes == rounded


@pytest.mark.parametrize(
    "nbytes, segment",
    [
        (1, 2 * MiB),
        (1 * MiB, 2 * MiB),  # the small pool
        (1 * MiB + 1, 20 * MiB),  # large, below 10 MiB: a 20 MiB segment
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),  # from 10 MiB on: rounded up to 2 MiB
        (11 * MiB + 1, 12 * MiB),
    ],
)
def test_segment_sizes(nbytes, segment):
    m = model()
    m.malloc(nbytes)
    assert segment_size(round_size(nbytes)) == segment
    assert m.reserved_bytes == segment == m.peak_reserved


def test_a_segment_that_would_exceed_the_capacity_is_not_allocated():
    m = model(capacity=30 * MiB)
    m.malloc(12 * MiB)
    with pytest.raises(ModelledOutOfMemory):
        m.malloc(20 * MiB)  # 12 + 20 > 30
    m.malloc(18 * MiB)  # control: 12 + 18 fits exactly
    assert m.reserved_bytes == 30 * MiB


# ------------------------------------------------------------ splitting and merging
def test_a_large_block_is_split_only_when_the_remainder_exceeds_1_mib():
    m = model()
    first = m.malloc(4 * MiB)  # a 20 MiB segment: 4 MiB + a 16 MiB free remainder
    assert first.size == 4 * MiB and m.reusable_bytes() == 16 * MiB
    waste = m.malloc(15 * MiB + 512 * 1024)  # remainder 0.5 MiB: stays with the block
    assert waste.size == 16 * MiB and waste.address == first.address + 4 * MiB
    assert m.reusable_bytes() == 0 and m.allocated_bytes == 20 * MiB

    control = model()
    control.malloc(4 * MiB)
    split = control.malloc(14 * MiB + 512 * 1024)  # remainder 1.5 MiB: split off
    assert split.size == 14 * MiB + 512 * 1024
    assert control.reusable_bytes() == 1 * MiB + 512 * 1024


def test_small_pool_blocks_are_packed_and_split_down_to_512_bytes():
    m = model()
    a, b = m.malloc(1000), m.malloc(1000)
    assert (a.size, b.size) == (1024, 1024) and b.address == a.address + 1024
    assert m.reserved_bytes == 2 * MiB
    # Control: a large request never takes small-pool memory, however much is free.
    m.malloc(1 * MiB + 512)
    assert m.reserved_bytes == 22 * MiB


def test_best_fit_takes_the_smallest_block_that_fits_then_the_lowest_address():
    m = model()
    sizes = (3 * MiB, 3 * MiB // 2, 2 * MiB, 3 * MiB // 2, 2 * MiB, 3 * MiB // 2)
    blocks = [m.malloc(n) for n in sizes]  # one 20 MiB segment, 8.5 MiB left
    for i in (0, 2, 4):
        m.free(blocks[i])  # free: 3 MiB at the start, 2 MiB, 2 MiB, and the 8.5 MiB tail
    assert m.malloc(2 * MiB).address == blocks[2].address  # smallest, then lowest address
    assert m.malloc(2 * MiB).address == blocks[4].address
    assert m.malloc(2 * MiB).address == blocks[0].address  # 3 MiB rather than the tail
    assert m.reserved_bytes == 20 * MiB


def test_adjacent_free_blocks_merge_into_one_that_fits_a_larger_request():
    m = model(capacity=40 * MiB)
    a, b, c = (m.malloc(6 * MiB) for _ in range(3))  # 18 MiB of a 20 MiB segment
    m.free(a)
    m.free(c)  # c merges with the 2 MiB tail: 6 MiB and 8 MiB free, not adjacent
    big = m.malloc(12 * MiB)  # control: fits in neither: a new 12 MiB segment
    assert m.reserved_bytes == 32 * MiB and big.address >= a.address + 20 * MiB
    m.free(b)  # a + b + c + tail: one 20 MiB block
    assert m.malloc(12 * MiB).address == a.address


def test_a_deferred_block_merges_only_once_its_copy_has_executed():
    m = model(capacity=64 * MiB)
    side = m.new_stream("d2h")
    a, b, c = (m.malloc(6 * MiB) for _ in range(3))
    end = offload_copy(m, a, side)
    m.record_stream(a, side)
    m.free(a)
    m.free(b)  # b is reusable at once, a only when its copy ended
    before = m.malloc(12 * MiB)
    assert before.address >= a.address + 20 * MiB  # a + b were not one free block yet
    m.compute(end - m.now)
    assert m.malloc(12 * MiB).address == a.address
    assert c.state == "allocated"


# ------------------------------------------------------------ stream-ordered reuse
def test_a_block_freed_without_record_stream_is_reused_at_once_by_its_stream():
    m = model()
    block = m.malloc(4 * MiB)
    m.free(block)
    again = m.malloc(4 * MiB)
    assert again.address == block.address and m.reserved_bytes == 20 * MiB
    assert m.reuse_timeline() == [(0.0, 4 * MiB)]


def test_another_stream_never_gets_a_cached_block():
    m = model()
    block = m.malloc(4 * MiB)
    side = m.new_stream("h2d")
    m.free(block)
    m.compute(10.0)  # long after every use
    other = m.malloc(4 * MiB, side)
    assert other.address >= block.address + 20 * MiB  # a new segment for the side stream
    assert m.reserved_bytes == 40 * MiB
    assert m.reusable_bytes(side) == 16 * MiB and m.reusable_bytes() == 20 * MiB


def test_another_stream_gets_the_memory_only_after_a_stall_waited_for_the_copy():
    m = model(capacity=20 * MiB)
    side = m.new_stream("d2h")
    block = m.malloc(16 * MiB)  # a 16 MiB segment
    end = offload_copy(m, block, side)
    m.record_stream(block, side)
    m.free(block)
    other = m.malloc(16 * MiB, side)  # no cached block of ``side``, no capacity: stall
    assert m.now == pytest.approx(end) == pytest.approx(16 * MiB / D2H)
    assert other.address >= block.address + 16 * MiB and m.num_alloc_retries == 1


# ------------------------------------------------------------ record_stream deferral
def test_a_recorded_block_is_reusable_exactly_when_its_copy_ends():
    m = model()
    side = m.new_stream("d2h")
    block = m.malloc(16 * MiB)
    m.compute(0.5)
    end = offload_copy(m, block, side)
    assert end == pytest.approx(0.5 + 16 * MiB / D2H)
    m.record_stream(block, side)
    m.free(block)
    assert m.reusable_bytes(at=end * (1 - 1e-9)) == 0
    assert m.reusable_bytes(at=end) == 16 * MiB
    early = m.malloc(16 * MiB)  # before the copy ended: fresh memory
    assert early.address != block.address and m.reserved_bytes == 32 * MiB
    m.compute(end - m.now)
    assert m.malloc(16 * MiB).address == block.address  # right at the end: reused
    assert m.reuse_timeline() == [(pytest.approx(end), 16 * MiB)]
    assert m.hazards == []


def test_without_record_stream_the_block_is_reused_under_its_copy():
    m = model()
    side = m.new_stream("d2h")
    block = m.malloc(16 * MiB)
    end = offload_copy(m, block, side)
    m.free(block)  # the negative control: record_stream is missing
    assert m.reusable_bytes() == 16 * MiB
    reused = m.malloc(8 * MiB)
    assert reused.address == block.address
    (hazard,) = m.hazards
    assert hazard.stream == side.name and hazard.copy_end == pytest.approx(end)
    assert hazard.nbytes == 8 * MiB and hazard.time == 0.0


def test_work_queued_on_the_recorded_stream_after_the_free_does_not_delay_reuse():
    m = model()
    side = m.new_stream("d2h")
    block = m.malloc(16 * MiB)
    first = offload_copy(m, block, side)
    m.record_stream(block, side)
    m.free(block)
    later = m.copy(side, 64 * MiB)  # queued after the free
    assert later > first
    assert m.reusable_bytes(at=first) == 16 * MiB

    control = model()  # the same work queued BEFORE the free delays it
    side = control.new_stream("d2h")
    block = control.malloc(16 * MiB)
    offload_copy(control, block, side)
    later = control.copy(side, 64 * MiB)
    control.record_stream(block, side)
    control.free(block)
    assert control.reusable_bytes(at=first) == 0
    assert control.reusable_bytes(at=later) == 16 * MiB


def test_record_stream_on_the_allocation_stream_defers_nothing():
    m = model()
    side = m.new_stream("d2h")
    block = m.malloc(4 * MiB, side)
    m.copy(side, 4 * MiB)
    m.record_stream(block, side)  # its own stream: ignored
    m.free(block)
    assert m.reusable_bytes(side) == 20 * MiB
    control = m.malloc(4 * MiB)  # the compute stream has nothing cached
    assert m.reusable_bytes() == 16 * MiB and control.address >= block.address + 20 * MiB


def test_blocks_released_one_by_one_come_back_progressively():
    m = model()
    side = m.new_stream("d2h")
    blocks = [m.malloc(16 * MiB) for _ in range(3)]
    ends = []
    for block in blocks:  # copy, record, free: one block at a time
        ends.append(offload_copy(m, block, side))
        m.record_stream(block, side)
        m.free(block)
    m.synchronize()
    assert m.reuse_timeline() == [(pytest.approx(e), 16 * MiB) for e in ends]

    control = model()  # all copies queued before the frees: all come back at the end
    side = control.new_stream("d2h")
    blocks = [control.malloc(16 * MiB) for _ in range(3)]
    for block in blocks:
        offload_copy(control, block, side)
        control.record_stream(block, side)
    for block in blocks:
        control.free(block)
    control.synchronize()
    assert control.reuse_timeline() == [(pytest.approx(ends[-1]), 16 * MiB)] * 3


# ------------------------------------------------------------ stalls and OOM
def test_fragmentation_stalls_then_raises_although_total_free_bytes_suffice():
    m = model(capacity=20 * MiB)
    a, b, c = (m.malloc(6 * MiB) for _ in range(3))
    m.free(a)
    m.free(c)
    assert m.reusable_bytes() == 14 * MiB  # >= 12 MiB, but in two pieces
    assert m.malloc(8 * MiB).address == c.address  # control: a piece that fits, no stall
    assert m.num_alloc_retries == 0
    with pytest.raises(ModelledOutOfMemory) as raised:
        m.malloc(12 * MiB)
    assert isinstance(raised.value, MemoryError)
    text = str(raised.value)
    for figure in (12 * MiB, 20 * MiB, m.reserved_bytes, m.allocated_bytes):
        assert str(figure) in text
    assert m.num_alloc_retries == 1 and m.oom_count == 1
    assert m.stalls[0].released == 0  # no segment was wholly free


def test_a_stall_waits_for_the_deferred_frees_and_is_counted():
    m = model(capacity=20 * MiB)
    side = m.new_stream("d2h")
    block = m.malloc(16 * MiB)
    m.compute(1.0)
    end = offload_copy(m, block, side)
    m.record_stream(block, side)
    m.free(block)
    new = m.malloc(8 * MiB)  # needs a 20 MiB segment: the 16 MiB one must go first
    (stall,) = m.stalls
    assert stall.time == 1.0 and stall.requested == 8 * MiB
    assert stall.waited == pytest.approx(end - 1.0) and m.now == pytest.approx(end)
    assert stall.released == 16 * MiB and "deferred" in stall.waited_for[0]
    assert m.reserved_bytes == 20 * MiB and new.size == 8 * MiB and m.oom_count == 0

    control = model(capacity=20 * MiB)  # the same allocation after the copy ended
    side = control.new_stream("d2h")
    block = control.malloc(16 * MiB)
    control.compute(1.0)
    end = offload_copy(control, block, side)
    control.record_stream(block, side)
    control.free(block)
    control.compute(end - control.now)
    assert control.malloc(8 * MiB).address == block.address
    assert control.stalls == [] and control.num_alloc_retries == 0


def test_the_cudafree_of_a_stall_waits_for_all_queued_work():
    m = model(capacity=20 * MiB)
    busy = m.new_stream("h2d")
    busy_end = m.copy(busy, 512 * MiB)  # unrelated, long
    m.free(m.malloc(16 * MiB))
    m.malloc(18 * MiB)  # releases the free 16 MiB segment: cudaFree synchronizes
    (stall,) = m.stalls
    assert stall.waited == pytest.approx(busy_end) and "cudaFree" in stall.waited_for[-1]

    control = model(capacity=40 * MiB)  # room for the segment: no stall, no wait
    busy = control.new_stream("h2d")
    control.copy(busy, 512 * MiB)
    control.free(control.malloc(16 * MiB))
    control.malloc(18 * MiB)
    assert control.stalls == [] and control.now == 0.0


def test_a_stall_retries_cudamalloc_only_not_the_blocks_its_wait_freed():
    m = model(capacity=20 * MiB)
    side = m.new_stream("d2h")
    keep, block = m.malloc(4 * MiB), m.malloc(12 * MiB)  # one segment, 4 MiB tail
    end = offload_copy(m, block, side)
    m.record_stream(block, side)
    m.free(block)
    with pytest.raises(ModelledOutOfMemory):
        m.malloc(12 * MiB)  # the wait frees the block, but the segment is split: no room
    assert m.now == pytest.approx(end)
    assert m.malloc(12 * MiB).address == block.address  # the next allocation finds it
    assert keep.state == "allocated"


def test_empty_cache_gives_wholly_free_segments_back():
    m = model()
    keep = m.malloc(4 * MiB)
    m.free(m.malloc(18 * MiB))
    assert m.reserved_bytes == 38 * MiB
    assert m.empty_cache() == 18 * MiB  # the split 20 MiB segment stays
    assert m.reserved_bytes == 20 * MiB and keep.state == "allocated"
    assert m.peak_reserved == 38 * MiB and m.stalls == []


# ------------------------------------------------------------ the clock
def test_copies_take_bytes_over_bandwidth_after_their_stream_and_waits():
    m = model(compute_copy_bandwidth=4e9)
    d2h, h2d = m.new_stream("d2h"), m.new_stream("h2d")
    m.compute(1.0)
    m.wait_stream(d2h, m.compute_stream)
    assert m.copy(d2h, 5e8) == pytest.approx(1.5)  # 0.5 s at 1 GB/s
    done = m.record_event(d2h)
    assert m.copy(d2h, 5e8) == pytest.approx(2.0)  # queued behind the first
    m.wait_event(h2d, done)
    assert m.copy(h2d, 1e9) == pytest.approx(2.0)  # starts at 1.5, 0.5 s at 2 GB/s
    free_h2d = m.new_stream("h2d")  # control: without the wait it starts at once
    assert m.copy(free_h2d, 1e9) == pytest.approx(1.5)
    assert m.now == 1.0  # side-stream copies do not move the compute stream
    assert m.copy(m.compute_stream, 2e9) == pytest.approx(1.5) == m.now  # 4 GB/s
    m.synchronize_event(m.record_event(d2h))
    assert m.now == pytest.approx(2.0)
    m.synchronize()
    assert m.now == pytest.approx(2.0)  # every stream had ended by then


def test_a_copy_does_not_start_before_it_is_issued_and_waits_move_the_clock():
    m = model()
    side = m.new_stream("d2h")
    m.compute(5.0)
    assert m.copy(side, 1e9) == pytest.approx(6.0)
    m.wait_event(m.compute_stream, m.record_event(side))  # no host run-ahead: now moves
    assert m.now == pytest.approx(6.0)
    m.wait_stream(side, m.compute_stream)
    assert m.record_event(side).time == pytest.approx(6.0)
    with pytest.raises(ValueError):
        m.reusable_bytes(at=1.0)  # before now
    with pytest.raises(ValueError):
        m.copy(m.new_stream(), 10)  # no direction anywhere


# ------------------------------------------------------------ MemPools (--use-nccl-ub)
NCCL = "nccl-registered"


def test_a_mempools_freed_blocks_serve_only_that_pool():
    """What ``--use-nccl-ub`` frees. Megatron-FSDP's buffers, its fp32 master weights included,
    come from a MemPool registered with NCCL; the optimizer's states from the default pool,
    where the forward pass allocates. Offloading the states frees memory the forward can use;
    releasing the masters gives it back to the pool only: the forward's allocation still needs
    memory of its own (here, more than the capacity leaves), while after the states' release
    it takes theirs."""
    states_bytes, masters_bytes, activations = 64 * MiB, 32 * MiB, 60 * MiB

    def run(free_states: bool, free_masters: bool):
        m = model(capacity=128 * MiB)
        states = m.malloc(states_bytes)
        masters = m.malloc(masters_bytes, pool=NCCL)
        if free_states:
            m.free(states)
        if free_masters:
            m.free(masters)
        found = m.reusable_bytes(), m.reusable_bytes(pool=NCCL)
        try:
            m.malloc(activations)  # the forward pass, in the default pool
            fits = True
        except ModelledOutOfMemory:
            fits = False
        return found, fits, m.num_alloc_retries

    (default, pooled), fits, _ = run(free_states=True, free_masters=False)
    assert default >= states_bytes and pooled == 0 and fits
    (default, pooled), fits, stalls = run(free_states=False, free_masters=True)
    assert default == 0 and pooled >= masters_bytes  # back in the pool, not for the forward
    assert not fits and stalls == 1  # even a stall does not give the pool's segment back
    # Control: the same masters in the default pool would have made room.
    m = model(capacity=128 * MiB)
    m.malloc(states_bytes)
    m.free(m.malloc(masters_bytes))
    assert m.reusable_bytes() >= masters_bytes


def test_a_block_freed_in_the_default_pool_does_not_serve_a_mempool():
    m = model()
    m.free(m.malloc(4 * MiB))
    assert m.reusable_bytes() > 0 and m.reusable_bytes(pool=NCCL) == 0
    reserved = m.reserved_bytes
    m.malloc(4 * MiB, pool=NCCL)  # a segment of its own
    assert m.reserved_bytes > reserved
