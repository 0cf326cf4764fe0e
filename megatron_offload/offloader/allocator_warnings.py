"""Allocator settings that make someone wait for the copy out: said once, with the figure.

Two settings undo part of what offloading gives, and nothing the offloader does can avoid
it, so it warns once per offloader, with the time measured in the run:

* ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``: a piece freed after ``record_stream``
  is handed back with ``cudaFreeAsync`` on its allocation stream once that stream waited for
  the copy out (``device/allocator.py``), so the compute stream waits for every D2H. The
  figure is the last completed copy out, read from the device's timing events.
* Megatron's ``--empty-unused-memory-level 2`` calls ``torch.cuda.empty_cache()`` right after
  the optimizer step, just after the states were offloaded: it blocks the host until every
  copy out is done and gives the freed pieces back to the driver, so the next reload must
  ``cudaMalloc`` them again. The figure is that host wait, measured once at the second
  offload (the first steady one) by waiting for the copies where ``empty_cache`` would.
"""

from __future__ import annotations

import time
import warnings

GIB = float(1 << 30)
STEADY_OFFLOAD = 2  # the first offload that follows a whole cycle (the first one lays out)


def warn_where_frees_wait(offloader) -> None:
    """Warn once, with the copy-out time, where releasing makes the compute stream wait."""
    engines = [e for e in offloader.engines if e.device.frees_wait_for_copies]
    if not engines:
        return
    handle = None

    def after_offload(_offloader) -> None:
        figures = [e.copies.times.read() for e in engines]
        if not all(f.get("d2h_ms") for f in figures):
            return  # not measured yet: the copy out of the first offload is still running
        ms = max(f["d2h_ms"] for f in figures)
        nbytes = sum(f["d2h_timed_bytes"] for f in figures)
        handle.remove()
        warnings.warn(
            "megatron-offload: the CUDA allocator runs with backend:cudaMallocAsync "
            "(PYTORCH_CUDA_ALLOC_CONF), which frees a released optimizer-state piece only once "
            f"the compute stream has waited for its copy to the host: {ms:.1f} ms per step "
            f"for {nbytes / GIB:.2f} GiB at the last offload. The native caching allocator (the "
            "default backend) hands each piece out again as soon as its own copy is done, "
            "without that wait.",
            RuntimeWarning,
            stacklevel=2,
        )

    handle = offloader.register_offload_post_hook(after_offload)


def warn_where_empty_cache_follows_the_step(offloader, level: int) -> None:
    """Megatron's ``--empty-unused-memory-level`` >= 2: warn once with the host wait."""
    if level < 2 or not any(e.device.is_accelerator for e in offloader.engines):
        return
    handle = None
    seen = 0

    def after_offload(_offloader) -> None:
        nonlocal seen
        seen += 1
        if seen < STEADY_OFFLOAD:
            return
        handle.remove()
        # The wait empty_cache() is about to make anyway (it synchronizes every event the
        # allocator holds, ours among them): made here first, to be measured.
        start = time.perf_counter()
        for engine in offloader.engines:
            engine.synchronize_host()
        waited_ms = (time.perf_counter() - start) * 1e3
        warnings.warn(
            f"megatron-offload: --empty-unused-memory-level {level} empties the CUDA cache right "
            "after the optimizer step, so the host waits for the optimizer states' copy to the "
            f"host ({waited_ms:.1f} ms measured at the offload after step {seen}) and the freed "
            "pieces go back to the driver, to be allocated again at the next reload. With "
            "offloading, use --empty-unused-memory-level 0 or 1.",
            RuntimeWarning,
            stacklevel=2,
        )

    handle = offloader.register_offload_post_hook(after_offload)
