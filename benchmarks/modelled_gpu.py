"""Modelled GPU: how soon the offloaded state's device memory is reusable, per layout.

No GPU is needed: the engine runs on a ``ModelledDevice`` (the checked stream model mirrored
into the caching-allocator model of ``megatron_offload_testing``), whose byte counts are
``scale`` times the real CPU tensors', so a few MiB of tensors stand for a 20 GB per-rank
state. For each link bandwidth and layout it reports, from the end of the step:

- the time until 50% and 100% of the state's device memory is reusable by the next forward
  pass (the caching allocator's view: a block freed under ``record_stream`` is reusable once
  the copy queued on the recorded stream at the free has executed), against the physical
  limit, bytes / bandwidth;
- the copies issued per offload;
- the allocation stalls (the allocator's synchronize + free-the-cache + retry path) of a
  forward pass that allocates activations of half the state's size at 80% of the link speed
  on a device of the state's size plus one 256 MiB piece.

Layouts: ``pieces`` (this project: pieces of at most 256 MiB, each freed right after its own
copy is queued), ``one block`` (one storage per kind and dtype, this project before bounded
pieces), ``per tensor`` (one storage per tensor, all freed after every copy was queued: the
layout of Megatron-LM PR #2811, whose release came after the offload).
"""

from __future__ import annotations

import torch

GB = 10**9
MiB = 1 << 20
DEFAULT_LINKS = (25 * GB, 50 * GB, 200 * GB)
PIECE = 256 * MiB
CHUNK = 64 * MiB  # modelled activation allocation
SLOWER = 1.25  # the forward allocates at 1/1.25 of the link speed
LAYOUTS = ("pieces", "one block", "per tensor")


def _tensors(total: int, count: int, scale: int, seed: int = 0) -> list[torch.Tensor]:
    """fp32 tensors of varied sizes adding up to about ``total`` modelled bytes."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=gen, dtype=torch.float64) + 0.25
    elements = (weights / weights.sum() * (total / scale / 4)).round().long().clamp(min=4)
    return [torch.zeros(int(n)) for n in elements]


def measure(
    layout: str,
    link: float,
    *,
    state_bytes: int = 20 * GB,
    tensors: int = 600,
    scale: int = 1 << 14,
) -> dict:
    """One offload after the step, modelled; see the module doc."""
    from megatron_offload.engine import OffloadEngine
    from megatron_offload_testing import ModelledDevice
    from megatron_offload_testing.allocator_model import segment_size

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    state = _tensors(state_bytes, tensors, scale)
    device = ModelledDevice(capacity=1 << 62, d2h_bandwidth=link, h2d_bandwidth=link, scale=scale)
    bound = {"pieces": PIECE // scale, "one block": None, "per tensor": 1}[layout]
    engine = OffloadEngine(
        device, lambda: (("optimizer_states", t) for t in state), max_piece_bytes=bound
    )
    model = device.model

    def offload():
        engine.mark_dirty()
        if layout == "per tensor":  # freed after every copy was queued, as PR #2811 did
            engine.offload()
            engine.release()
        else:
            engine.offload(release=True)

    for _ in range(2):  # the first reload consolidates; then the layout is steady
        offload()
        engine.reload()
        engine.wait()
    total = sum(g.nbytes for g in engine.pieces) * scale
    # The device: the state plus one 256 MiB piece, from a clean cache.
    model.empty_cache()
    model.capacity = sum(segment_size(g.nbytes * scale) for g in engine.pieces) + segment_size(
        PIECE
    )
    stalls_before = model.num_alloc_retries
    t0 = model.now  # the step ends: the offload is issued now
    offload()
    copies = engine.stats()["d2h_copies"]
    # The next forward pass allocates activations of half the state at 80% of the link speed.
    device.settle()
    blocks = []
    try:
        for _ in range(-(-total // 2 // CHUNK)):
            model.compute(CHUNK / link * SLOWER)
            blocks.append(model.malloc(CHUNK))
        oom = False
    except MemoryError:
        oom = True
    stalls = model.num_alloc_retries - stalls_before
    model.synchronize()
    reusable, half, full = 0, None, None
    for when, nbytes in model.reuse_timeline():
        if when < t0 or nbytes < 0:
            continue
        reusable += nbytes
        if half is None and reusable >= total / 2:
            half = when - t0
        if reusable >= total and full is None:
            full = when - t0
    for block in blocks:
        model.free(block)
    floor = total / link
    return {
        "layout": layout,
        "link": link,
        "bytes": total,
        "copies": copies,
        "stalls": stalls,
        "oom": oom,
        "half_s": half,
        "full_s": full,
        "floor_s": floor,
        "half_ratio": None if half is None else half / floor,
        "full_ratio": None if full is None else full / floor,
    }


def run(links=DEFAULT_LINKS, **options) -> list[dict]:
    return [measure(layout, link, **options) for link in links for layout in LAYOUTS]


def print_rows(rows: list[dict]) -> None:
    print(
        "\n== Modelled GPU: device memory reusable after the step (caching-allocator model, "
        f"{rows[0]['bytes'] / GB:.1f} GB per rank)"
    )
    print(
        f"  {'link':>9} {'layout':<11} {'50% reusable':>18} {'100% reusable':>18} {'floor':>9} "
        f"{'copies':>7} {'stalls':>7}"
    )
    for r in rows:

        def at(seconds, ratio):
            return "never" if seconds is None else f"{seconds * 1e3:8.1f} ms {ratio:5.2f}x"

        print(
            f"  {r['link'] / GB:>5.0f} GB/s {r['layout']:<11} {at(r['half_s'], r['half_ratio']):>18} "
            f"{at(r['full_s'], r['full_ratio']):>18} {r['floor_s'] * 1e3:>6.1f} ms {r['copies']:>7} "
            f"{r['stalls']:>7}{' OOM' if r['oom'] else ''}"
        )
