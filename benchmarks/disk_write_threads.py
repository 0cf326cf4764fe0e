"""How many writes the disk tier should have running at once: its offload with 1, 2 and 3 write
threads, interleaved in one process, against one plain sequential write of the same bytes.

    python -m benchmarks.disk_write_threads                   # 512 MiB, 16 repeats, ./.disk-tier-bench
    python -m benchmarks.disk_write_threads --repeats 32 --dir /nvme/offload

The same engine and state as ``benchmarks.disk_tier`` (everything but the staging's share of
the budget on disk). Each repeat runs one offload and reload per thread count, in an order that
alternates, then the plain write (over a file written before, as the tier's is): the disk's
rate moves from one second to the next on a virtual machine, so only figures taken side by
side compare. The write threads are swapped by
giving the tier's write pool another size between cycles (what ``WRITE_THREADS`` sets).
Reported: the median write rate of each, and in how many repeats each thread count beat one
thread. docs/disk-tier.md has the figures measured here.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks import disk_tier

THREADS = (1, 2, 3)


def measure(*, mib: int, directory: str, repeats: int, piece_mib: int = 256) -> dict:
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine import disk
    from megatron_offload.engine.disk import staging_bytes

    device = CPUDevice()
    total, piece = mib << 20, piece_mib << 20
    tensors = disk_tier._tensors(total, device.torch_device)
    engine = disk_tier._engine(device, tensors, staging_bytes(piece, total // 2), directory, piece)
    disk_tier._cycle(engine, device)  # lays the pieces out: not timed
    on_disk = sum(g.nbytes for g in engine.pieces if g.disk is not None)
    direct = engine.host.disk is not None and engine.host.disk.direct is not None
    mapping = mmap.mmap(-1, on_disk)  # page-aligned, as direct I/O wants
    torch.frombuffer(mapping, dtype=torch.uint8).random_(generator=torch.Generator().manual_seed(1))
    plain = disk_tier.PlainFile(directory, memoryview(mapping), direct)
    pools = {n: ThreadPoolExecutor(n, thread_name_prefix="offload-write") for n in THREADS}
    saved = disk._POOLS.get("write")
    rates: dict = {n: [] for n in THREADS}
    rates["plain"] = []
    before = disk_tier.cpu_times()
    try:
        for index in range(repeats):
            for n in THREADS if index % 2 == 0 else THREADS[::-1]:
                disk._POOLS["write"] = (os.getpid(), pools[n])
                rates[n].append(on_disk / disk_tier._cycle(engine, device)[0] / 1e9)
            rates["plain"].append(on_disk / plain.write() / 1e9)
    finally:
        if saved is None:
            disk._POOLS.pop("write", None)
        else:
            disk._POOLS["write"] = saved
        for pool in pools.values():
            pool.shutdown()
        engine.close()
        plain.close()
    return {
        "disk_tier_bytes": on_disk,
        "direct_writes": direct,
        "gbps": {str(k): v for k, v in rates.items()},
        "median_gbps": {str(k): statistics.median(v) for k, v in rates.items()},
        "beat_one_thread": {
            str(n): sum(a > b for a, b in zip(rates[n], rates[1])) for n in THREADS[1:]
        },
        "repeats": repeats,
        "cpu_steal": disk_tier.steal_share(before, disk_tier.cpu_times()),
    }


def report(figures: dict) -> str:
    median, plain = figures["median_gbps"], figures["median_gbps"]["plain"]
    lines = [
        f"{figures['disk_tier_bytes'] / 2**20:.0f} MiB written per offload "
        f"({'O_DIRECT' if figures['direct_writes'] else 'buffered'}), "
        f"{figures['repeats']} interleaved repeats; plain sequential write {plain:.2f} GB/s"
    ]
    for n in THREADS:
        won = figures["beat_one_thread"].get(str(n))
        lines.append(
            f"  {n} write thread{'s' if n > 1 else ' '}: {median[str(n)]:.2f} GB/s, "
            f"ratio {median[str(n)] / plain:.2f}"
            + ("" if won is None else f", faster than one thread in {won} of {figures['repeats']}")
        )
    stolen = figures["cpu_steal"]
    lines.append(
        "CPU stolen by the hypervisor: " + ("not known" if stolen is None else f"{stolen:.0%}")
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dir", default=".disk-tier-bench")
    parser.add_argument("--repeats", type=int, default=16)
    args = parser.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    print(report(measure(mib=args.mib, directory=args.dir, repeats=args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
