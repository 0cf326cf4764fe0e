"""Real megatron-core training on the caching-allocator model: is the freed memory reusable in time?

The offloader runs on a ``ModelledDevice`` (the checked stream model, mirrored into an
``AllocatorModel``) while 2 gloo ranks train a bf16 GPT with overlapped gradient reduce and
parameter gather. The model's byte counts are ``SCALE`` times the real ones, so the tiny test
model stands for a rank holding a few GiB of optimizer state, offloaded over a PCIe-class link.

Each iteration, in modelled time: the forward pass allocates activations (half the state's
size, in ``CHUNK`` pieces, a little slower than the link copies: a stall-free run is
physically possible), the backward pass frees them, then the real training step runs: the
states are regrown and copied back, updated, and copied out again piece by piece. After two
warm-up iterations the device capacity is set to what the run needs if freed memory were
reusable at once (the larger of the step's and the forward's residency) plus one piece (the
largest: a tensor over the bound is a piece of its own).

The chunked update runs the same way: its states stay on the host and pass through two
device slots during the step; a slot is freed as one block, so for the spare it counts as
a piece.

Asserted: in steady state no allocation stalls (the model's ``num_alloc_retries``) and none
runs out of memory; after the last step the state's memory becomes reusable piece by piece,
each piece exactly when its own copy has crossed the link; training is bitwise the same as
without offloading. Negative controls: one storage per group (no piece bound)
stalls under the same capacity and workload; dropping ``record_stream`` is reported as reuse
before the copy.
"""

import argparse
import dataclasses
import re
import warnings

import pytest

from tests.harness.compare import assert_bitwise_equal

SCALE = 4096  # modelled bytes per real byte
PIECE = 16 << 10  # real max_piece_bytes: 64 MiB modelled
LINK = 25e9  # bytes/s each way (PCIe Gen4 x16)
MIB = 1 << 20
CHUNK = 16 * MIB  # modelled activation allocation: a quarter of a piece, a whole 2 MiB multiple
SLOWER = 1.25  # the forward allocates at 1/1.25 of the link speed
STEPS, WARMUP = 6, 2
CHUNKED = 160 << 10  # real chunked_update_bytes: two slots of 320 MiB modelled
BUILD = dict(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000)


class _Forward:
    """The modelled activations: allocated during the forward, freed during the backward."""

    def __init__(self, model, nbytes):
        self.model, self.count, self.blocks = model, -(-nbytes // CHUNK), []

    def forward(self):
        for _ in range(self.count):
            # Compute that produces one chunk of activations, then its allocation.
            self.model.compute(CHUNK / LINK * SLOWER)
            self.blocks.append(self.model.malloc(CHUNK))

    def backward(self):
        while self.blocks:
            self.model.compute(CHUNK / LINK * SLOWER)
            self.model.free(self.blocks.pop())


def modelled_job(
    max_piece_bytes,
    *,
    offload=True,
    capacity=None,
    skip_labels=(),
    chunked=None,
    max_split=None,
    honour_split=True,
    backend="native",
    empty_cache_level=None,
):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _modelled_job(
            max_piece_bytes,
            offload=offload,
            capacity=capacity,
            skip_labels=skip_labels,
            chunked=chunked,
            max_split=max_split,
            honour_split=honour_split,
            backend=backend,
            empty_cache_level=empty_cache_level,
        )
    out["warnings"] = [str(w.message) for w in caught if "megatron-offload" in str(w.message)]
    return out


def _modelled_job(
    max_piece_bytes,
    *,
    offload,
    capacity,
    skip_labels,
    chunked,
    max_split,
    honour_split,
    backend,
    empty_cache_level,
):
    from megatron_offload import attach
    from megatron_offload_testing import ModelledDevice
    from megatron_offload_testing.allocator_model import segment_size
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16", **BUILD)
    devices = []

    def factory(torch_device):
        devices.append(
            ModelledDevice(
                capacity=1 << 62,
                d2h_bandwidth=LINK,
                h2d_bandwidth=LINK,
                scale=SCALE,
                skip_labels=skip_labels,
                raise_violations=not skip_labels,
                max_split_size=max_split,
                backend=backend,
            )
        )
        if not honour_split:  # negative control: pieces as if the allocator had no bound
            devices[-1].piece_bound = lambda: None
        return devices[-1]

    options = {"device_factory": factory, "max_piece_bytes": max_piece_bytes}
    if chunked:
        options["chunked_update_bytes"] = chunked
    if empty_cache_level is not None:
        # Megatron's route: attach_for_training with the run's arguments.
        from megatron_offload.config import OffloadConfig
        from megatron_offload.megatron import training as hooks

        args = argparse.Namespace(
            offload_optimizer_states=True, empty_unused_memory_level=empty_cache_level
        )
        offload_config = OffloadConfig(
            **{**dataclasses.asdict(hooks.config_from_args(args)), **options}
        )
        original, hooks.config_from_args = hooks.config_from_args, lambda _args: offload_config
        try:
            offloader = hooks.attach_for_training(optimizer, args)
        finally:
            hooks.config_from_args = original
    else:
        offloader = attach(optimizer, **options) if offload else None
    results, figures = [], []
    forward = None
    for step in range(STEPS):
        model = devices[0].model if devices else None
        if step == WARMUP - 1 and model is not None:  # the layout (pieces) exists from here on
            forward = _Forward(model, offloader.stats()["tracked_bytes"] * SCALE // 2)
        if forward is not None:
            devices[0].settle()  # blocks whose tensors died in the step (the slots) are free
            forward.forward()
            forward.backward()
        if step == WARMUP - 1 and model is not None:
            # Steady state starts from a clean cache (torch.cuda.empty_cache()) and a device
            # of the residency of the step or of the forward, whichever is larger, plus one
            # piece (the largest: a tensor over the bound is a piece of its own).
            model.empty_cache()
            sizes = [
                segment_size(g.nbytes * SCALE)
                for e in offloader.engines
                for g in e.pieces
                if not g.streamed
            ]
            # The chunked update's two slots are the streamed states' residency in the step,
            # and a slot is freed as one block: for the spare, a slot counts as a piece.
            slots = [segment_size(chunked // 2 * SCALE)] * 2 if chunked else []
            step_need = sum(sizes) + sum(slots)
            forward_need = forward.count * segment_size(CHUNK)
            model.capacity = capacity or max(step_need, forward_need) + max(sizes + slots)
            figures.append(
                {
                    "capacity": model.capacity,
                    "state": offloader.stats()["tracked_bytes"] * SCALE,
                    "step_need": step_need,
                    "forward_need": forward_need,
                    "spare": max(sizes + slots),
                }
            )
        stalls = model.num_alloc_retries if model is not None else 0
        results.append(models.train_step(chunks, optimizer, config, step))
        if forward is not None and step >= WARMUP:
            t0 = model.now  # the step just ended: its D2H copies start now
            figures.append(
                {
                    "step": step,
                    "stalls": model.num_alloc_retries - stalls,
                    "t0": t0,
                    "ooms": model.oom_count,
                }
            )
    out = {"results": results, "figures": figures}
    if offloader is not None:
        model = devices[0].model
        stats = offloader.stats()
        # Pieces in copy order (each engine copies its groups in order; one engine here).
        pieces = [g.nbytes * SCALE for e in offloader.engines for g in e.pieces]
        t0 = figures[-1]["t0"]
        model.synchronize()  # let every copy finish in modelled time
        out.update(
            timeline=[(t, n) for t, n in model.reuse_timeline() if t >= t0],
            pieces=pieces,
            pieces_per_kind=stats["pieces"],
            t0=t0,
            violations=[(v.rule, v.kind) for d in devices for v in d.violations],
            hazards=len(model.hazards),
            stall_log=[(s.time, s.requested, s.waited, s.waited_for) for s in model.stalls],
        )
        model.capacity = 1 << 62  # the snapshot below needs everything back at once
        offloader.reload()
        offloader.wait()
    models.flush_param_gather(chunks)
    out["snapshot"] = models.snapshot(chunks, optimizer)
    return out


@pytest.fixture(scope="module")
def reference(rank_pool):
    return rank_pool.run(modelled_job, PIECE, offload=False)


@pytest.fixture(scope="module")
def pieces_run(rank_pool):
    return rank_pool.run(modelled_job, PIECE)


def test_no_stall_in_steady_state_and_bitwise(reference, pieces_run):
    assert_bitwise_equal(reference, pieces_run)
    for rank in pieces_run:
        setup, *steady = rank["figures"]
        assert setup["state"] > 2 * 1024 * MIB  # a rank with GiBs of state, modelled
        assert len(steady) == STEPS - WARMUP
        assert [f["stalls"] for f in steady] == [0] * len(steady), rank["stall_log"]
        assert all(f["ooms"] == 0 for f in steady)
        assert rank["violations"] == [] and rank["hazards"] == 0
        assert all(count > 1 for count in rank["pieces_per_kind"].values())


def test_chunked_update_has_no_stall_in_steady_state_and_is_bitwise(rank_pool, reference):
    """The chunked update on the model: the states stay on the host during the step and
    pass through two device slots; the masters are reloaded whole, in pieces."""
    run = rank_pool.run(modelled_job, PIECE, chunked=CHUNKED)
    assert_bitwise_equal(reference, run)
    for rank in run:
        setup, *steady = rank["figures"]
        assert setup["step_need"] < setup["state"]  # the step holds less than the state
        assert [f["stalls"] for f in steady] == [0] * len(steady), rank["stall_log"]
        assert all(f["ooms"] == 0 for f in steady)
        assert rank["violations"] == [] and rank["hazards"] == 0


def test_memory_becomes_reusable_piece_by_piece_at_link_speed(pieces_run):
    from megatron_offload_testing.allocator_model import round_size

    for rank in pieces_run:
        t0, pieces, timeline = rank["t0"], rank["pieces"], rank["timeline"]
        # Every piece comes back on its own, in copy order, when its own copy has crossed
        # the link: t0 + (bytes copied up to and including it) / bandwidth.
        assert len(timeline) == len(pieces)
        for (_, block), nbytes in zip(timeline, pieces):  # a block keeps a remainder <= 1 MiB
            assert round_size(nbytes) <= block <= round_size(nbytes) + MIB
        done = 0
        for (when, _), nbytes in zip(timeline, pieces):
            done += nbytes
            assert when == pytest.approx(t0 + done / LINK, rel=1e-9)
        # Half the state is reusable after about half the transfer, not at its end.
        half = next(when for when, _ in _cumulative(timeline) if _ >= sum(pieces) / 2)
        assert half - t0 <= 0.55 * sum(pieces) / LINK


def _cumulative(timeline):
    total = 0
    for when, nbytes in timeline:
        total += nbytes
        yield when, total


def test_one_storage_per_group_stalls_under_the_same_capacity(rank_pool, pieces_run):
    """Negative control: today's layout (one storage per kind and dtype) needs the whole
    group's copy before any of its memory is reusable, so the forward stalls."""
    capacity = pieces_run[0]["figures"][0]["capacity"]
    whole = rank_pool.run(modelled_job, 1 << 62, capacity=capacity)  # no bound: one per group
    for rank in whole:
        steady = rank["figures"][1:]
        assert sum(f["stalls"] for f in steady) >= len(steady) - 1, rank["stall_log"]
        assert all(count == 1 for count in rank["pieces_per_kind"].values())


def test_pieces_stay_splittable_under_max_split_size(rank_pool):
    """``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:160`` on the model: a freed block of 160 MiB
    or more is never split, and a smaller request never takes one, so the activations
    cannot use a released piece of that size. The engine lowers its pieces (256 MiB asked
    for) to the device's bound, 158 MiB, whose segments stay under 160 MiB: no stall in
    steady state. Negative control: the same run with the bound ignored stalls under the
    same capacity."""
    split = 160 * MIB
    run = rank_pool.run(modelled_job, 4 * PIECE, max_split=split)
    control = rank_pool.run(
        modelled_job,
        4 * PIECE,
        max_split=split,
        honour_split=False,
        capacity=run[0]["figures"][0]["capacity"],
    )
    for rank in run:
        assert max(rank["pieces"]) <= split - 2 * MIB, rank["pieces"]
        steady = rank["figures"][1:]
        assert [f["stalls"] for f in steady] == [0] * len(steady), rank["stall_log"]
        assert all(f["ooms"] == 0 for f in steady)
    for rank in control:
        assert max(rank["pieces"]) > split
        steady = rank["figures"][1:]
        assert sum(f["stalls"] + f["ooms"] for f in steady) >= len(steady) - 1, rank["stall_log"]


def test_cuda_malloc_async_is_said_once_with_the_wait_it_costs(rank_pool, reference, pieces_run):
    """``backend:cudaMallocAsync`` on the model: a piece freed under ``record_stream`` goes back
    once the compute stream waited for its copy out. Nothing avoids that wait, so the
    offloader says so once, with the measured copy time. The native run says nothing."""
    run = rank_pool.run(modelled_job, PIECE, backend="cudaMallocAsync")
    assert_bitwise_equal(reference, run)
    for rank, native in zip(run, pieces_run):
        assert native["warnings"] == []
        assert len(rank["warnings"]) == 1, rank["warnings"]
        (message,) = rank["warnings"]
        assert "backend:cudaMallocAsync" in message
        ms = float(re.search(r"([0-9.]+) ms per step for [0-9.]+ GiB", message).group(1))
        # The modelled copy out of the whole state (the bytes the model sees) over the link.
        assert ms == pytest.approx(rank["figures"][0]["state"] / LINK * 1e3, rel=0.02), message


def test_empty_cache_after_the_step_is_said_once_with_the_host_wait(rank_pool):
    """``--empty-unused-memory-level 2`` through ``attach_for_training``: one warning, at the
    first steady offload, with the measured host wait; level 1 says nothing."""
    two = rank_pool.run(modelled_job, PIECE, empty_cache_level=2)
    one = rank_pool.run(modelled_job, PIECE, empty_cache_level=1)
    for rank in two:
        assert len(rank["warnings"]) == 1, rank["warnings"]
        assert re.search(
            r"--empty-unused-memory-level 2 .* \([0-9.]+ ms measured at the offload after step 2\)",
            rank["warnings"][0],
        ), rank["warnings"]
    for rank in one:
        assert rank["warnings"] == []


def test_dropped_record_stream_is_reported_as_reuse_before_the_copy(rank_pool):
    from megatron_offload_testing import REUSE_BEFORE_COPY

    run = rank_pool.run(modelled_job, PIECE, skip_labels=("d2h-record-stream",))
    for rank in run:
        assert rank["hazards"] > 0  # the forward got memory a queued copy still reads
        assert (2, REUSE_BEFORE_COPY) in rank["violations"]
