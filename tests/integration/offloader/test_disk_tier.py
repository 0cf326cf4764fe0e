"""The disk tier (``offload_disk_dir``) on real megatron-core: a bf16 GPT on 2 gloo ranks with
a host budget of 40% of its states and masters trains bitwise as the same run without
offloading, whole and with the chunked update, while

* the rest lives in a file under the directory both ranks share (``disk_bytes``), with no
  name in it (unlinked from the start) and nothing open or mapped there after ``detach``;
* between steps, the optimizer states and masters hold 0 bytes of device memory, the arena
  holds at most the budget, and the page cache of the file (measured here with ``mincore``,
  apart from ``stats()``) is 0: host memory stays within the budget, not the file's size.

Jobs run in rank processes (a touched released tensor kills the rank and fails the test with
its exit code).
"""

from __future__ import annotations

import pytest

from tests.harness.compare import differences

STEPS = 3
FRACTION = 0.4  # of the states and masters the host budget holds


def disk_directory(tmp_path_factory) -> str:
    """A directory on a disk for the tier (pytest's temporary directory, unless that is
    tmpfs, which the tier refuses: then one in the checkout)."""
    import os

    from megatron_offload.engine.disk import MEMORY_FILESYSTEMS, filesystem_type

    directory = str(tmp_path_factory.mktemp("disk-tier"))
    if filesystem_type(directory) in MEMORY_FILESYSTEMS:
        directory = os.path.abspath(os.path.join(".disk-tier-tests", os.path.basename(directory)))
        os.makedirs(directory, exist_ok=True)
    return directory


def _page_cache_bytes(buffer) -> int:
    """Bytes of ``buffer``'s pages in the page cache, by ``mincore`` (apart from the package's
    own figure)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    pages = -(-buffer.numel() // page)
    vector = (ctypes.c_ubyte * pages)()
    mincore = ctypes.CDLL(None).mincore
    assert mincore(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.numel()), vector) == 0
    return sum(1 for byte in bytes(vector) if byte & 1) * page


def _device_bytes(optimizer) -> int:
    """Bytes of the raw storages of the optimizer states and fp32 masters, each once."""
    import torch

    from tests.harness import models

    seen, total = set(), 0
    for wrapper in models.megatron_optimizers(optimizer):
        tensors = [m for group in wrapper.shard_fp32_from_float16_groups for m in group]
        for state in dict.values(wrapper.optimizer.state):  # the raw mapping, not a guarded read
            tensors += [v for v in dict.values(state) if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.numel() > 1 and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _held_in(directory: str) -> list[str]:
    """This process's open files and mappings under ``directory``."""
    import os

    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory):
            held.append(target)
    with open("/proc/self/maps") as maps:
        held += [line.split(None, 5)[-1].strip() for line in maps if directory in line]
    return held


def disk_job(directory: str | None, chunked: bool):
    import gc
    import os

    import megatron_offload
    from tests.harness import models
    from tests.harness.checkpoints import chunked_options

    chunks, optimizer, config = models.build("gpt", "bf16")
    options = chunked_options(optimizer, {}) if chunked else {}
    results, between, offloader = [], [], None
    if directory is not None:
        probe = megatron_offload.attach(optimizer, **options)
        need = probe.stats()["host_bytes"]  # the arena for every state and master
        probe.detach()
        budget = int(need * FRACTION)
        options.update(host_memory_budget=budget, offload_disk_dir=directory)
        offloader = megatron_offload.attach(optimizer, **options)
    for step in range(STEPS):
        results.append(models.train_step(chunks, optimizer, config, step))
        if offloader is not None:
            stats = offloader.stats()
            files = [e.host.disk.buffer for e in offloader.engines if e.host.disk is not None]
            between.append(
                {
                    "need": need,
                    "budget": budget,
                    "host_bytes": stats["host_bytes"],
                    "disk_bytes": stats["disk_bytes"],
                    "device_bytes": _device_bytes(optimizer),
                    "page_cache": sum(_page_cache_bytes(b) for b in files),
                    "disk_resident_bytes": stats["disk_resident_bytes"],
                    "names": os.listdir(directory),
                    "offloaded_bytes": stats["offloaded_bytes"],
                }
            )
    snapshot = models.final_snapshot(chunks, optimizer, offloader)
    left = None
    if offloader is not None:
        offloader.detach()
        del files
        gc.collect()
        left = _held_in(directory)
    return {"results": results, "snapshot": snapshot, "between": between, "left": left}


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_a_budget_under_half_trains_bitwise_with_the_rest_on_disk(
    rank_pool, tmp_path_factory, chunked
):
    directory = disk_directory(tmp_path_factory)
    plain = rank_pool.run(disk_job, None, chunked)
    tiered = rank_pool.run(disk_job, directory, chunked)
    for reference, run in zip(plain, tiered, strict=True):
        assert not differences(reference, run)
        for figures in run["between"]:
            assert figures["device_bytes"] == 0, figures
            assert figures["host_bytes"] <= figures["budget"] < figures["need"] / 2, figures
            assert figures["host_bytes"] + figures["disk_bytes"] >= figures["need"], figures
            assert figures["disk_bytes"] > figures["need"] / 2, figures
            assert figures["page_cache"] == figures["disk_resident_bytes"] == 0, figures
            assert figures["names"] == [], figures  # unlinked: no name, even for a moment
        assert run["left"] == []  # nothing open or mapped there after detach
