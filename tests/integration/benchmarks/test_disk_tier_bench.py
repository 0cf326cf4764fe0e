"""``benchmarks/disk_tier.py`` at a small size: the tier's bytes come back bitwise, it holds
no page cache after an offload and no more host memory than its budget, and every figure the
report prints is measured (a GB/s for each side and way, the ratios between them). The ratio
itself depends on the disk, its load and the CPU a hypervisor leaves at the moment (the run
prints the share stolen): it is read from a full run
(``python -m benchmarks.disk_tier``), not asserted here."""

from __future__ import annotations


def test_the_disk_tier_benchmark_measures_both_sides(tmp_path_factory):
    from benchmarks.disk_tier import measure, report
    from tests.harness.disk import disk_directory

    figures = measure(
        mib=24,
        directory=disk_directory(tmp_path_factory),
        repeats=2,
        host_fraction=0.25,
        piece_mib=4,
    )
    assert figures["bitwise"]
    held = figures["held"]
    assert held["page_cache_after_offload"] == 0, held
    assert 0 < held["host_bytes"] <= held["budget"], held
    assert figures["disk_tier_bytes"] >= figures["total_bytes"] // 2, figures
    for side in ("tier", "plain"):
        for way in ("write", "read", "read_fresh"):
            assert figures[f"{side}_{way}_gbps"] > 0, (side, way)
    # The plain write with the device memory given back is slower than the write alone by
    # the release it timed, and that release is what the goal's ratio is read against.
    assert figures["plain_release_ms"] > 0
    assert figures["plain_write_released_gbps"] < figures["plain_write_gbps"]
    for way in ("write", "write_released", "read", "read_fresh"):
        assert figures[f"{way}_ratio"] == (
            figures[f"tier_{way}_gbps"] / figures[f"plain_{way}_gbps"]
        )
    assert figures["met"] == (
        figures["write_released_ratio"] >= 0.8 and figures["read_fresh_ratio"] >= 0.8
    )
    cycle = figures["cycle_ms"]
    assert cycle["disk tier"] > 0 and cycle["host tier"] > 0 and cycle["no offloading"] == 0
    stolen = figures["cpu_steal"]
    assert stolen is None or 0 <= stolen < 1, stolen
    ticks = figures["stolen_ticks_per_repeat"]
    assert len(ticks) == 2 and all(t is None or t >= 0 for t in ticks), ticks
    unstolen = figures["unstolen"]
    assert unstolen["of"] == 2 and unstolen["repeats"] == ticks.count(0), unstolen
    printed = report(figures)
    assert "ratio" in printed and "page cache of the file 0 bytes" in printed
    assert "CPU stolen by the hypervisor during the repeats" in printed
    assert f"repeats with no CPU stolen: {unstolen['repeats']} of 2" in printed


def test_the_plain_side_overwrites_one_file_written_before_as_the_tier_does(tmp_path_factory):
    """The plain side's file is allocated and written once, then each repeat writes over it
    (a new file would be slower to write on some filesystems, docs/disk-tier.md), reads it
    back bitwise, and leaves nothing behind once closed."""
    import mmap
    import os

    import torch

    from benchmarks.disk_tier import PlainFile
    from tests.harness.disk import disk_directory, held_in

    directory = disk_directory(tmp_path_factory)
    mapping = mmap.mmap(-1, 1 << 20)
    source = torch.frombuffer(mapping, dtype=torch.uint8)
    source.random_(generator=torch.Generator().manual_seed(3))
    expected = source.clone()
    plain = PlainFile(directory, memoryview(mapping), direct=False)
    inode = os.fstat(plain.fd).st_ino
    assert os.pread(plain.fd, 1 << 20, 0) == expected.numpy().tobytes()  # written at once
    times = [plain.cycle() for _ in range(2)]
    assert all(seconds > 0 for row in times for seconds in row), times
    assert os.fstat(plain.fd).st_ino == inode  # the same file, written over
    assert torch.equal(source, expected)  # read back into the source bitwise
    plain.close()
    assert held_in(directory) == [] and os.listdir(directory) == []


def test_the_unstolen_ratios_read_only_the_repeats_that_lost_no_cpu():
    """Rows as ``measure`` keeps them, in seconds: the tier's (write, read) and the plain
    side's (write, read, read into fresh memory, release). The repeat that lost ticks is left
    out of the ratios, whatever its times."""
    from benchmarks.disk_tier import _unstolen_ratios

    rows = {
        "tier": [(2.0, 4.0), (100.0, 100.0), (2.0, 4.0)],
        "plain": [(1.0, 9.0, 2.0, 1.0), (1.0, 9.0, 2.0, 1.0), (1.0, 9.0, 2.0, 1.0)],
    }
    calm = _unstolen_ratios(rows, [0, 3, 0], nbytes=8)
    assert calm == {"repeats": 2, "of": 3, "write_released_ratio": 1.0, "read_fresh_ratio": 0.5}
    assert _unstolen_ratios(rows, [1, None, 2], nbytes=8) == {"repeats": 0, "of": 3}


def test_the_steal_share_is_read_from_the_cpu_line():
    """``/proc/stat``'s ``cpu`` line: user nice system idle iowait irq softirq steal guest
    guest_nice (guest time is inside user time, so not added again)."""
    from benchmarks.disk_tier import cpu_times, steal_share

    before = cpu_times("cpu  100 0 50 800 10 0 0 40 7 0\ncpu0 50 0 25 400 5 0 0 20 7 0\n")
    after = cpu_times("cpu  160 0 70 900 10 0 0 110 9 0\n")
    assert before == (1000, 40) and after == (1250, 110)
    assert steal_share(before, after) == 70 / 250
    assert steal_share(before, before) is None and steal_share(None, after) is None
    assert cpu_times("intr 1 2 3\n") is None
    assert cpu_times() is None or cpu_times()[0] > 0


def test_the_write_threads_benchmark_measures_each_count_and_puts_the_pool_back(
    tmp_path_factory,
):
    """``benchmarks/disk_write_threads.py`` at a small size: a rate for each thread count and
    the plain write, each repeat counted once per comparison, and the tier's own write pool in
    place afterwards (the benchmark swaps it between cycles)."""
    from benchmarks.disk_write_threads import THREADS, measure, report
    from megatron_offload.engine import disk
    from tests.harness.disk import disk_directory

    figures = measure(mib=8, directory=disk_directory(tmp_path_factory), repeats=2, piece_mib=4)
    assert figures["disk_tier_bytes"] == 8 << 20
    for key in [str(n) for n in THREADS] + ["plain"]:
        assert len(figures["gbps"][key]) == 2 and figures["median_gbps"][key] > 0, key
    assert set(figures["beat_one_thread"]) == {str(n) for n in THREADS[1:]}
    assert all(0 <= won <= 2 for won in figures["beat_one_thread"].values())
    assert disk._io("write")._max_workers == disk.WRITE_THREADS
    assert "3 write threads" in report(figures)
