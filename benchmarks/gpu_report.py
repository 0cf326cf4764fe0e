"""The pretrain example on real GPUs, with and without offloading: memory, copies, step time.

    python -m benchmarks.gpu_report                      # 1 GPU, and all GPUs when there are several
    python -m benchmarks.gpu_report --save-logs DIR      # also keep every run's log
    python -m benchmarks.gpu_report --from-logs DIR      # report on saved logs again, run nothing

Runs examples/pretrain_gpt.py (a small bf16 GPT on mock data, NCCL) through
``benchmarks.gpu_report_job``: with offloading through ``megatron_offload.launch`` and
``--offload-optimizer-states``, without it as the plain script; on one GPU (one process),
then with torchrun on every GPU. Prints per configuration and rank the device memory freed by
the offload (expected against ``torch.cuda.memory_allocated``), memory between steps, peak
and reserved memory, ``num_alloc_retries`` per iteration, the offload's D2H/H2D GB/s against a
pinned ``copy_(non_blocking=True)`` of the same size timed in the same run, step time on and
off (overhead), and the copy time the compute stream waited for (exposed).

Exit status: 0 when every guard holds, 1 when a guard fails or a run fails, 2 without a CUDA
GPU (it never passes without having measured). Guards, judged after ``--warmup`` iterations:
memory freed, ``num_alloc_retries`` not growing, offload bandwidth >= 0.7x the copy
benchmark, lm loss and grad norm bitwise equal on and off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_offload_testing.pretrain_flags import gpt_flags, schedule_flags

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "pretrain_gpt.py"
JOB = "benchmarks.gpu_report_job"
NEEDS_GPU = "benchmarks.gpu_report needs a CUDA GPU (torch.cuda.is_available() is False here); nothing was measured."
BANDWIDTH_MIN_RATIO = 0.7  # offload GB/s against the copy benchmark of the same size
FREED_MIN_RATIO = 0.99  # allocator drop at the offload against the bytes it should free
GIB = float(1 << 30)
MIB = float(1 << 20)

JOB_LINE = re.compile(r"\[gpu-report\] (\{.*\})\s*$", re.MULTILINE)


# ------------------------------------------------------------------------------ parsing
def parse_offload_lines(log: str) -> list[dict]:
    """The offloader's log lines (reduced over ranks), in order."""
    from megatron_offload_testing.log_lines import parse_log_lines

    return parse_log_lines(log)


def parse_job_lines(log: str) -> dict:
    """``{"iterations": {rank: [record, ...]}, "copy_bench": {rank: record}}`` from a run's log."""
    out: dict = {"iterations": {}, "copy_bench": {}}
    for match in JOB_LINE.finditer(log):
        record = json.loads(match.group(1))
        if record["kind"] == "iteration":
            out["iterations"].setdefault(record["rank"], []).append(record)
        elif record["kind"] == "copy_bench":
            out["copy_bench"][record["rank"]] = record
    for records in out["iterations"].values():
        records.sort(key=lambda r: r["iteration"])
    return out


# ------------------------------------------------------------------------------ figures
def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def step_times(records: list[dict], warmup: int) -> list[float]:
    """Seconds from the start of one iteration to the start of the next, after warm-up
    (host clock, no synchronization: the offload's copies overlap the next forward as in
    training); the last iteration counts to its own end."""
    times = [
        b["t_entry"] - a["t_entry"] for a, b in zip(records, records[1:]) if a["iteration"] > warmup
    ]
    if records and records[-1]["iteration"] > warmup:
        times.append(records[-1]["t_exit"] - records[-1]["t_entry"])
    return times


def rank_figures(on: list[dict], off: list[dict], bench: dict | None, warmup: int) -> dict:
    """Figures of one rank: ``on``/``off`` its iteration records with and without offloading."""
    steady_on = [r for r in on if r["iteration"] > warmup]
    steady_off = [r for r in off if r["iteration"] > warmup]
    stats = [r["stats"] or {} for r in steady_on]
    fig: dict = {
        "iterations_on": [r["iteration"] for r in on],
        "iterations_off": [r["iteration"] for r in off],
        "freed": [(r["iteration"], r["freed"], r["expected_freed"]) for r in steady_on],
        "state_bytes": steady_on[-1]["state_bytes"] if steady_on else None,
        "offloaded_payload_bytes": stats[-1].get("offloaded_payload_bytes") if stats else None,
        "retries_on": [r["alloc_retries"] for r in on],
        "retries_off": [r["alloc_retries"] for r in off],
    }
    for name, run in (("on", steady_on), ("off", steady_off)):
        fig[f"between_steps_{name}"] = _median(r["allocated_entry"] for r in run)
        fig[f"peak_{name}"] = max(
            (r["max_allocated"] for r in run if r["max_allocated"] is not None), default=None
        )
        fig[f"reserved_{name}"] = max(
            (r["reserved"] for r in run if r["reserved"] is not None), default=None
        )
    fig["step_on"] = _median(step_times(on, warmup))
    fig["step_off"] = _median(step_times(off, warmup))
    for key in ("d2h_ms", "h2d_ms", "d2h_gbps", "h2d_gbps", "exposed_ms", "d2h_bytes", "h2d_bytes"):
        fig[key] = _median(s.get(key) for s in stats)
    # Where the arena's pages are (device/numa.py): the node, whether bound, and why not.
    fig["numa"] = (
        {key: stats[-1].get(key) for key in ("numa_node", "numa_bound", "numa_note")}
        if stats
        else None
    )
    fig["bench"] = bench
    fig["losses_on"] = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in on}
    fig["losses_off"] = {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in off}
    return fig


def run_figures(on_log: str, off_log: str, warmup: int) -> dict:
    """Figures of one configuration from the logs of its two runs."""
    on, off = parse_job_lines(on_log), parse_job_lines(off_log)
    ranks = sorted(set(on["iterations"]) | set(off["iterations"]))
    per_rank = {
        rank: rank_figures(
            on["iterations"].get(rank, []),
            off["iterations"].get(rank, []),
            on["copy_bench"].get(rank),
            warmup,
        )
        for rank in ranks
    }
    steps_on = [f["step_on"] for f in per_rank.values() if f["step_on"] is not None]
    steps_off = [f["step_off"] for f in per_rank.values() if f["step_off"] is not None]
    step_on, step_off = (
        (max(steps_on) if steps_on else None),
        (max(steps_off) if steps_off else None),
    )
    return {
        "ranks": per_rank,
        "warmup": warmup,
        "offload_lines": parse_offload_lines(on_log),
        "step_on": step_on,
        "step_off": step_off,
        "overhead_pct": (step_on / step_off - 1) * 100 if step_on and step_off else None,
    }


# ------------------------------------------------------------------------------- guards
def guards(fig: dict) -> list[tuple[str, str, bool]]:
    """(guard, what was measured, held) for one configuration; a missing figure fails."""
    rows = []
    ranks = fig["ranks"]
    complete = bool(ranks) and all(
        f["iterations_on"]
        and f["iterations_on"] == f["iterations_off"]
        and f["iterations_on"] == list(range(1, len(f["iterations_on"]) + 1))
        and len(f["iterations_on"]) > fig["warmup"] + 1
        for f in ranks.values()
    )
    rows.append(
        (
            "every rank logged every iteration on and off, beyond the warm-up",
            "; ".join(
                f"rank {r}: on {len(f['iterations_on'])}, off {len(f['iterations_off'])}"
                for r, f in ranks.items()
            )
            or "no iteration lines",
            complete,
        )
    )
    # Memory freed: the allocator's drop across each offload against what it should free.
    lows, text = [], []
    for rank, f in ranks.items():
        ratios = [
            None if freed is None or not expected else freed / expected
            for _, freed, expected in f["freed"]
        ]
        low = None if not ratios or None in ratios else min(ratios)
        payload_ok = (
            f["state_bytes"] is not None and f["offloaded_payload_bytes"] == f["state_bytes"]
        )
        lows.append(low if payload_ok else None)
        text.append(
            f"rank {rank}: lowest freed/expected {_ratio(low)}, offloaded payload "
            f"{_bytes(f['offloaded_payload_bytes'])} of the state's {_bytes(f['state_bytes'])}"
        )
    rows.append(
        (
            f"memory freed by the offload >= {FREED_MIN_RATIO} x expected, every state byte offloaded",
            "; ".join(text),
            bool(lows) and all(low is not None and low >= FREED_MIN_RATIO for low in lows),
        )
    )
    # Allocator retries after the warm-up.
    growth, text = [], []
    for rank, f in ranks.items():
        retries = f["retries_on"]
        baseline = retries[fig["warmup"] - 1] if 0 < fig["warmup"] <= len(retries) else 0
        grew = None if len(retries) <= fig["warmup"] or None in retries else retries[-1] - baseline
        growth.append(grew)
        text.append(
            f"rank {rank}: +{grew if grew is not None else 'n/a'} after iteration {fig['warmup']}"
        )
    rows.append(
        (
            "num_alloc_retries does not grow after the warm-up (offloading on)",
            "; ".join(text),
            bool(growth) and all(g == 0 for g in growth),
        )
    )
    # Bandwidth against the copy benchmark.
    ok, text = bool(ranks), []
    for rank, f in ranks.items():
        bench = f["bench"] or {}
        for way in ("d2h", "h2d"):
            measured, floor = f[f"{way}_gbps"], bench.get(f"{way}_gbps")
            ratio = measured / floor if measured is not None and floor else None
            ok = ok and ratio is not None and ratio >= BANDWIDTH_MIN_RATIO
            text.append(
                f"rank {rank} {way.upper()} {_gbps(measured)} vs {_gbps(floor)} ({_ratio(ratio)})"
            )
    rows.append(
        (
            f"offload bandwidth >= {BANDWIDTH_MIN_RATIO} x pinned copy_ of the same size",
            "; ".join(text),
            ok,
        )
    )
    # Losses bitwise equal.
    differ, compared = [], 0
    for rank, f in ranks.items():
        for it in sorted(set(f["losses_on"]) | set(f["losses_off"])):
            a, b = f["losses_on"].get(it), f["losses_off"].get(it)
            compared += a is not None and a[0] is not None
            if a != b:
                differ.append(f"rank {rank} it {it}: {a} vs {b}")
    rows.append(
        (
            "lm loss and grad norm bitwise equal on and off",
            f"{compared} losses compared"
            + (f"; differ: {'; '.join(differ[:4])}" if differ else ""),
            compared > 0 and not differ,
        )
    )
    return rows


def exit_status(rows: list[tuple[str, str, bool]], failed_runs: list[str]) -> int:
    return 1 if failed_runs or not rows or not all(ok for _, _, ok in rows) else 0


# ------------------------------------------------------------------------------- report
def _bytes(n) -> str:
    return "n/a" if n is None else f"{n / MIB:.1f} MiB"


def _gbps(x) -> str:
    return "n/a" if x is None else f"{x:.2f} GB/s"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


def _ms(x, scale=1.0) -> str:
    return "n/a" if x is None else f"{x * scale:.3f} ms"


def _increments(cumulative: list) -> str:
    if None in cumulative:
        return "n/a"
    steps = [b - a for a, b in zip([0] + cumulative, cumulative)]
    return f"{steps} (total {cumulative[-1] if cumulative else 0})"


def format_report(label: str, fig: dict, rows: list) -> str:
    lines = [f"== {label}: {len(fig['ranks'])} rank(s), figures after iteration {fig['warmup']}"]
    for rank, f in fig["ranks"].items():
        freed = [(it, a, e) for it, a, e in f["freed"] if a is not None]
        last = freed[-1] if freed else (None, None, None)
        lines += [
            f"  rank {rank}",
            f"    freed by the offload (iteration {last[0]}): measured {_bytes(last[1])}, expected {_bytes(last[2])}"
            f"; state {_bytes(f['state_bytes'])}, offloaded payload {_bytes(f['offloaded_payload_bytes'])}",
            f"    allocated between steps: on {_bytes(f['between_steps_on'])}, off {_bytes(f['between_steps_off'])}"
            + (
                f" (off - on {_bytes(f['between_steps_off'] - f['between_steps_on'])})"
                if None not in (f["between_steps_on"], f["between_steps_off"])
                else ""
            ),
            f"    peak allocated: on {_bytes(f['peak_on'])}, off {_bytes(f['peak_off'])}; "
            f"reserved: on {_bytes(f['reserved_on'])}, off {_bytes(f['reserved_off'])}",
            f"    num_alloc_retries per iteration: on {_increments(f['retries_on'])}, off {_increments(f['retries_off'])}",
        ]
        bench = f["bench"] or {}
        for way in ("d2h", "h2d"):
            lines.append(
                f"    {way.upper()}: {_ms(f[f'{way}_ms'])} for {_bytes(f[f'{way}_bytes'])} = "
                f"{_gbps(f[f'{way}_gbps'])}; pinned copy_ {_ms(bench.get(f'{way}_ms'))} for "
                f"{_bytes(bench.get(f'{way}_bytes'))} = {_gbps(bench.get(f'{way}_gbps'))}"
            )
        exposed = f["exposed_ms"]
        share = (
            f" ({exposed / (f['step_on'] * 1e3) * 100:.1f}% of the step)"
            if exposed is not None and f["step_on"]
            else ""
        )
        lines.append(
            f"    step: on {_ms(f['step_on'], 1e3)}, off {_ms(f['step_off'], 1e3)}; "
            f"exposed copy time {_ms(exposed)}{share}"
        )
        place = f.get("numa") or {}
        if place:
            node = place.get("numa_node")
            lines.append(
                f"    host arena NUMA node: {'n/a' if node in (None, -1) else node}, "
                f"{'bound' if place.get('numa_bound') else 'not bound'}"
                + (f" ({place['numa_note']})" if place.get("numa_note") else "")
            )
    overhead = fig["overhead_pct"]
    lines.append(
        f"  step time (slowest rank, median): on {_ms(fig['step_on'], 1e3)}, off {_ms(fig['step_off'], 1e3)}"
        f", overhead {'n/a' if overhead is None else f'{overhead:+.1f}%'}"
    )
    if fig["offload_lines"]:
        o = fig["offload_lines"][-1]
        lines.append(
            f"  offloader's last log line (over {o['ranks']} rank(s)), iteration {o['iteration']}: "
            f"D2H {o['d2h_ms']:.3f} ms ({o['d2h_gbps']:.2f} GB/s), H2D {o['h2d_ms']:.3f} ms "
            f"({o['h2d_gbps']:.2f} GB/s), exposed {o['exposed_ms']:.3f} ms, issue {o['issue_ms']:.3f} ms"
        )
    else:
        lines.append("  offloader's log line: none found in the log")
    lines += [f"  [{'PASS' if ok else 'FAIL'}] {name}: {measured}" for name, measured, ok in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- commands
def megatron_flags(args, world_size: int) -> list[str]:
    """The example's flags for ``world_size`` data-parallel ranks (one global batch is
    ``--micro-batches`` micro-batches per rank)."""
    return [
        *gpt_flags(
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            seq_length=args.seq_length,
            vocab=args.vocab,
        ),
        "--micro-batch-size",
        str(args.micro_batch),
        "--global-batch-size",
        str(args.micro_batch * args.micro_batches * world_size),
        *schedule_flags(lr="1e-4", min_lr="1e-5"),
        "--train-iters",
        str(args.iters),
        "--bf16",
        "--log-interval",
        "1",
        "--distributed-backend",
        "nccl",
        *shlex.split(args.megatron_args),
    ]


def command(
    world_size: int, offload: bool, flags: list[str], python: str = sys.executable
) -> list[str]:
    """One GPU: a single process (the job makes its own group of one); several: torchrun."""
    launcher = (
        [python]
        if world_size == 1
        else [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world_size}",
        ]
    )
    return [
        *launcher,
        "-m",
        JOB,
        "launch" if offload else "direct",
        str(EXAMPLE),
        *flags,
        *(["--offload-optimizer-states"] if offload else []),
    ]


def configurations(gpus: int) -> list[int]:
    """World sizes to run: 1, and every GPU when there are several."""
    return [1] + ([gpus] if gpus > 1 else [])


def environment(base=None, *, megatron_fsdp: bool = False) -> dict:
    """The jobs' environment; ``megatron_fsdp``: without CUDA_DEVICE_MAX_CONNECTIONS=1, which
    Megatron-FSDP refuses."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    if megatron_fsdp:
        del env["CUDA_DEVICE_MAX_CONNECTIONS"]
    return env


def run_job(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run one training job; (exit code, combined output). NOT EXERCISED with a GPU."""
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            env=environment(megatron_fsdp="--use-megatron-fsdp" in cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out + f"\n(timed out after {timeout:.0f} s)"
    return proc.returncode, proc.stdout


def _label(world_size: int) -> str:
    return "1 GPU" if world_size == 1 else f"{world_size} GPUs"


def _log_name(world_size: int, offload: bool) -> str:
    return f"world{world_size}.{'on' if offload else 'off'}.log"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank and step")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="iterations not judged (first offloads, allocator warm-up)",
    )
    p.add_argument(
        "--megatron-args",
        default="",
        help="extra flags for both runs, given with '=': --megatron-args='--deterministic-mode'",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per training run")
    p.add_argument("--save-logs", metavar="DIR", help="write each run's log to DIR")
    p.add_argument(
        "--from-logs", metavar="DIR", help="report on the logs a --save-logs run wrote; run nothing"
    )
    p.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logs: dict = {}
    failed: list[str] = []
    if args.from_logs:
        folder = Path(args.from_logs)
        for world in sorted({int(p.name.split(".")[0][5:]) for p in folder.glob("world*.*.log")}):
            logs[world] = {on: (folder / _log_name(world, on)).read_text() for on in (True, False)}
        if not logs:
            print(f"no world*.on.log / world*.off.log in {folder}", file=sys.stderr)
            return 2
        print(f"figures from the logs in {folder} (measured when they were written)")
    else:
        import torch

        if not torch.cuda.is_available():
            print(NEEDS_GPU, file=sys.stderr)
            return 2
        # NOT EXERCISED: from here on this branch needs a GPU; nothing of it has run on one.
        from .gpu import NOT_EXERCISED
        from .timing import machine

        info = machine()
        print(
            f"[{NOT_EXERCISED}]\n{info['date']}; {info.get('gpu')}; {torch.cuda.device_count()} GPU(s); "
            f"torch {info['torch']}"
        )
        for world in configurations(torch.cuda.device_count()):
            logs[world] = {}
            for offload in (True, False):
                cmd = command(world, offload, megatron_flags(args, world))
                print(f"$ {shlex.join(cmd)}", flush=True)
                code, logs[world][offload] = run_job(cmd, args.timeout)
                if args.save_logs:
                    os.makedirs(args.save_logs, exist_ok=True)
                    Path(args.save_logs, _log_name(world, offload)).write_text(logs[world][offload])
                if code != 0:
                    failed.append(
                        f"{_label(world)}, offloading {'on' if offload else 'off'}: exit code {code}"
                    )
                    print("\n".join(logs[world][offload].splitlines()[-40:]), file=sys.stderr)
    all_rows, results = [], {}
    for world, pair in logs.items():
        fig = run_figures(pair[True], pair[False], args.warmup)
        rows = guards(fig)
        all_rows += rows
        results[_label(world)] = {"figures": fig, "guards": rows}
        print("\n" + format_report(_label(world), fig, rows))
    for failure in failed:
        print(f"run failed: {failure}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1, default=str)
    status = exit_status(all_rows, failed)
    print("\nall guards held" if status == 0 else "\na guard failed or a run failed (see above)")
    return status


if __name__ == "__main__":
    sys.exit(main())
