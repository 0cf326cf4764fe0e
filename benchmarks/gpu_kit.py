"""The GPU kit's own figures, in one process on one GPU; and the kit's results table.

    python -m benchmarks.gpu_kit measure --json kit.json [--cap-gib 24]   # needs a CUDA GPU
    python -m benchmarks.gpu_kit measure --dry-run --json kit.json        # the same logic on CPU
    python -m benchmarks.gpu_kit table WORK OUT                           # OUT/results.md and .json

``scripts/gpu.sh run`` runs the GPU tests, ``benchmarks.gpu_report`` (the pretrain example on
and off: memory freed, allocator retries, bitwise losses, D2H/H2D against a pinned copy, step
overhead) and then this module, which adds what needs many models in one process. Each
figure is taken with offloading and without it, one model at a time, on megatron-core's
DistributedOptimizer (bf16 GPT, Adam, one NCCL rank), built by ``tests.harness.models``:

- ``freed``: device memory one ``offload()`` gives back, against 12 bytes per parameter of
  the shard (fp32 master weight, exp_avg, exp_avg_sq);
- ``micro_batch``: the largest micro-batch that trains three steps under a device-memory cap
  (``--cap-gib``, ``torch.cuda.set_per_process_memory_fraction``), on and off, and
  ``num_alloc_retries`` after the warm-up at the smallest micro-batch that only fits with
  offloading (one that uses the freed memory);
- ``width``: the largest hidden size (multiples of 256) that trains under the same cap;
- ``checkpoint``: a ``dist_checkpointing.save`` of model and optimizer (median of three),
  offloaded (served from the host copy) against resident;
- ``fork``: ``fork()`` milliseconds and the child's private bytes of the arena's mapping,
  against a pinned buffer of the same size from torch's own allocator (the control);
- ``numa``: the arena's NUMA node, whether its pages were bound there, and why not.

Goals (exit status 1 when one is missed, 2 without a GPU): freed >= 0.99 x 12 B/param;
largest micro-batch on > off; no retries after the warm-up at that micro-batch; largest
width on >= off; the save on <= 1.05 x off; the child holds <= 1% of the arena privately.

NOT EXERCISED on a GPU by the development machines (they have none): the ``--dry-run`` path,
which runs in the test suite on CPU ranks, is what is known to work; figures that need CUDA
are None there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

NEEDS_GPU = "benchmarks.gpu_kit measure needs a CUDA GPU (torch.cuda.is_available() is False here); nothing was measured."
BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq, for bf16 parameters under Adam
FREED_MIN_RATIO = 0.99
SAVE_MAX_RATIO = 1.05
FORK_PRIVATE_MAX = 0.01
STEPS, WARMUP = 3, 1
WIDTH_STEP = 256
GIB = float(1 << 30)


# ------------------------------------------------------------------------------ one process
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init(dry_run: bool) -> torch.device:
    """One rank: NCCL on cuda:0, or gloo with megatron-core's CUDA calls redirected (dry run)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dry_run:
        from megatron_offload_testing import cpu_megatron

        cpu_megatron.install()
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo" if dry_run else "nccl",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
    )
    parallel_state.initialize_model_parallel(1, 1)
    return torch.device("cpu") if dry_run else torch.device("cuda", 0)


def shutdown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class Trial:
    """One model (built fresh: a failed trial leaves nothing behind), optionally offloaded."""

    def __init__(
        self,
        device,
        *,
        offload: bool,
        hidden: int,
        layers: int,
        seq: int,
        micro_batch: int,
        vocab: int,
    ) -> None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        import megatron_offload
        from tests.harness import models

        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        self.device = device
        self.chunks, self.optimizer, self.config = models.build(
            "gpt",
            "bf16",
            num_layers=layers,
            hidden=hidden,
            heads=max(1, hidden // 128),
            vocab_size=vocab,
            seq_length=seq,
            micro_batch_size=micro_batch,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            bucket_size=40_000_000,
        )
        self.offloader = megatron_offload.attach(self.optimizer) if offload else None
        self.params = sum(p.numel() for chunk in self.chunks for p in chunk.parameters())

    def step(self, index: int) -> dict:
        from .megatron_bench import _train_step

        ok = _train_step(self.chunks, self.optimizer, self.config, index, self.device)
        _sync(self.device)
        return {"ok": bool(ok)}

    def close(self) -> None:
        if self.offloader is not None and not self.offloader.detached:
            with contextlib.suppress(Exception):
                self.offloader.reload()
                self.offloader.wait()
                self.offloader.detach()
        self.chunks = self.optimizer = self.config = self.offloader = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _retries(device):
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.type == "cuda" else None


def _trains(device, offload: bool, steps: int = STEPS, **shape) -> dict | None:
    """Train ``steps`` steps of a fresh model of ``shape``: figures, or None when it ran out of memory."""
    trial = None
    try:
        trial = Trial(device, offload=offload, **shape)
        retries = []
        for index in range(steps):
            trial.step(index)
            retries.append(_retries(device))
        return {"retries": retries, "params": trial.params}
    except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
        # Out of memory may also surface from a collective or a library as a RuntimeError
        # naming it; anything else is a real failure.
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            return None
        raise
    finally:
        if trial is not None:
            trial.close()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def largest(fits, start: int, unit: int, limit: int) -> int:
    """The largest multiple of ``unit`` in [unit, limit] for which ``fits`` holds (0 if none):
    doubling from ``start``, then bisection (``fits`` is assumed monotone)."""
    good, bad = 0, None
    value = start
    while value <= limit:
        if fits(value):
            good, value = value, value * 2
        else:
            bad = value
            break
    hi = bad if bad is not None else (limit // unit + 1) * unit  # every mid below is <= limit
    while hi - good > unit:
        mid = (good + hi) // 2 // unit * unit
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            hi = mid
    return good


# ------------------------------------------------------------------------------- figures
def freed_figure(device, shape: dict) -> dict:
    """What one ``offload()`` gives back, against 12 bytes per parameter of the shard."""
    trial = Trial(device, offload=True, **shape)
    try:
        for index in range(2):
            trial.step(index)
        trial.offloader.reload()
        trial.offloader.wait()
        figures = {
            "params_per_shard": trial.params,
            "expected": BYTES_PER_PARAM * trial.params,
            "freed": None,
        }
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            trial.offloader.offload()
            torch.cuda.synchronize()
            torch.empty(1, device=device)  # lets the allocator process the recorded frees
            figures["freed"] = before - torch.cuda.memory_allocated()
        figures["numa"] = {
            k: trial.offloader.stats().get(k) for k in ("numa_node", "numa_bound", "numa_note")
        }
        figures["fork"] = fork_figure(trial.offloader.engines[0].host_arena, device)
        return figures
    finally:
        trial.close()


def micro_batch_figure(device, shape: dict, limit: int) -> dict:
    out = {}
    for offload in (False, True):
        out["on" if offload else "off"] = largest(
            lambda b: _trains(device, offload, **{**shape, "micro_batch": b}) is not None,
            1,
            1,
            limit,
        )
    out["retries_at"] = None
    if out["on"] > out["off"]:
        at = out["off"] + 1  # the smallest micro-batch that needs the freed memory
        run = _trains(device, True, steps=STEPS + 3, **{**shape, "micro_batch": at})
        out["retries_at"] = at
        retries = run["retries"] if run else None
        out["retries_after_warmup"] = (
            None if not retries or None in retries else retries[-1] - retries[WARMUP]
        )
    return out


def width_figure(device, shape: dict, limit: int) -> dict:
    out = {}
    for offload in (False, True):
        out["on" if offload else "off"] = largest(
            lambda h: _trains(device, offload, **{**shape, "hidden": h}) is not None,
            shape["hidden"],
            WIDTH_STEP,
            limit,
        )
    return out


def checkpoint_figure(device, shape: dict, repeats: int = 3) -> dict:
    """Seconds of a ``dist_checkpointing.save`` of model and optimizer: offloaded and resident."""
    from megatron.core import dist_checkpointing

    out = {}
    for offload in (False, True):
        trial = Trial(device, offload=offload, **shape)
        times = []
        try:
            for index in range(2):
                trial.step(index)
            for _ in range(repeats):
                where = tempfile.mkdtemp(prefix="gpu-kit-ckpt-")
                try:
                    _sync(device)
                    start = time.perf_counter()
                    model = trial.chunks[0].sharded_state_dict()
                    # dp_reshardable: megatron-core 0.19.2 cannot save its default sharding type
                    # (fully_sharded_model_space: "flattened_range is not supported").
                    optimizer = trial.optimizer.sharded_state_dict(
                        model, metadata={"distrib_optim_sharding_type": "dp_reshardable"}
                    )
                    state = {"model": model, "optimizer": optimizer}
                    dist_checkpointing.save(state, where)
                    _sync(device)
                    times.append(time.perf_counter() - start)
                finally:
                    shutil.rmtree(where, ignore_errors=True)
            if trial.offloader is not None:
                out["still_offloaded"] = trial.offloader.is_offloaded
        finally:
            trial.close()
        out["on" if offload else "off"] = statistics.median(times)
    return out


def disk_tier_figure(device, dry_run: bool) -> dict:
    """``benchmarks.disk_tier`` on this device: the disk tier's cycle against a plain
    sequential write and read of the same bytes, in a directory of the checkout (removed
    after)."""
    from benchmarks import disk_tier
    from megatron_offload.errors import DiskTierError

    directory = os.path.abspath(".disk-tier-bench")
    os.makedirs(directory, exist_ok=True)
    try:
        return disk_tier.measure(
            mib=16 if dry_run else 1024,
            directory=directory,
            repeats=3,
            host_fraction=0.0,
            piece_mib=4 if dry_run else 256,
            device_name=device.type,
        )
    except DiskTierError as error:  # a checkout on tmpfs: no disk to measure
        return {"error": str(error)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def mapping_private_bytes(address: int) -> int:
    """Private bytes of this process's mapping that holds ``address`` (from smaps)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as handle:
        for line in handle:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith(("Private_Dirty", "Private_Clean")):
                total += int(line.split()[1]) * 1024
    return total


def timed_fork(report) -> tuple[float, int]:
    """(milliseconds ``os.fork()`` took, the integer ``report()`` returns in the child); the
    child reports and leaves at once (it never touches CUDA)."""
    read, write = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.write(write, str(report()).encode())
        os._exit(0)
    forked_ms = (time.perf_counter() - start) * 1e3
    child = int(os.read(read, 64))
    os.waitpid(pid, 0)
    os.close(read)
    os.close(write)
    return forked_ms, child


def _fork(buffer: torch.Tensor) -> dict:
    forked_ms, child = timed_fork(lambda: mapping_private_bytes(buffer.data_ptr()))
    return {"fork_ms": forked_ms, "child_private_bytes": child, "bytes": buffer.numel()}


def fork_figure(arena: torch.Tensor, device) -> dict:
    """Fork with the (pinned, shared) arena, and with a pinned buffer of torch's own (the control)."""
    nbytes = arena.numel()
    if device.type == "cuda":
        control = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    else:  # no pinning on CPU: a private mapping, faulted in
        control = torch.frombuffer(
            mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
        )
    control.fill_(1)
    return {"arena": _fork(arena), "control": _fork(control)}


# -------------------------------------------------------------------------------- goals
def goals(fig: dict) -> list[tuple[str, str, bool]]:
    """(goal, what was measured, met) for the kit's figures; a missing figure misses."""
    rows = []
    missing = [
        name
        for name in ("freed", "checkpoint", "disk_tier", "micro_batch", "width")
        if name not in fig
    ]
    if missing:
        rows.append(("every figure measured", f"not measured: {', '.join(missing)}", False))
    fig = {
        "freed": {"expected": 0, "params_per_shard": 0, "fork": None},
        "micro_batch": {"on": 0, "off": 0},
        "width": {"on": 0, "off": 0},
        "checkpoint": {"on": 0.0, "off": 0.0},
        **fig,
    }
    freed = fig["freed"]
    ratio = (
        freed["freed"] / freed["expected"]
        if freed.get("freed") is not None and freed["expected"]
        else None
    )
    rows.append(
        (
            f"offload() frees >= {FREED_MIN_RATIO} x 12 B/param of the shard",
            f"{_gib(freed.get('freed'))} freed, {_gib(freed['expected'])} expected "
            f"({freed['params_per_shard']:,} params): {_ratio(ratio)}",
            ratio is not None and ratio >= FREED_MIN_RATIO,
        )
    )
    mb = fig["micro_batch"]
    rows.append(
        (
            "largest micro-batch under the cap: on > off",
            f"on {mb['on']}, off {mb['off']}",
            mb["on"] > mb["off"],
        )
    )
    grew = mb.get("retries_after_warmup")
    rows.append(
        (
            "num_alloc_retries after the warm-up, at a micro-batch that uses the freed memory",
            f"+{grew} at micro-batch {mb.get('retries_at')}",
            grew == 0,
        )
    )
    width = fig["width"]
    rows.append(
        (
            "largest hidden size under the cap: on >= off",
            f"on {width['on']}, off {width['off']}",
            width["on"] >= width["off"] > 0,
        )
    )
    ckpt = fig["checkpoint"]
    ratio = ckpt["on"] / ckpt["off"] if ckpt.get("off") else None
    rows.append(
        (
            f"checkpoint save while offloaded <= {SAVE_MAX_RATIO} x resident",
            f"on {ckpt['on'] * 1e3:.1f} ms, off {ckpt['off'] * 1e3:.1f} ms ({_ratio(ratio)}); "
            f"still offloaded after: {ckpt.get('still_offloaded')}",
            ratio is not None and ratio <= SAVE_MAX_RATIO and bool(ckpt.get("still_offloaded")),
        )
    )
    disk = fig.get("disk_tier") or {}
    if "write_ratio" in disk:
        measured = (
            f"write {disk['tier_write_gbps']:.2f} vs {disk['plain_write_released_gbps']:.2f} "
            f"GB/s with the device memory given back ({_ratio(disk['write_released_ratio'])}) "
            f"and {disk['plain_write_gbps']:.2f} alone ({_ratio(disk['write_ratio'])}), read "
            f"{disk['tier_read_gbps']:.2f} vs "
            f"{disk['plain_read_fresh_gbps']:.2f} GB/s into fresh memory "
            f"({_ratio(disk['read_fresh_ratio'])}) and {disk['plain_read_gbps']:.2f} into a "
            f"reused buffer; bitwise {disk['bitwise']}, page cache after an offload "
            f"{disk['held']['page_cache_after_offload']} B"
        )
    else:
        measured = disk.get("error", "not measured")
    rows.append(
        (
            "disk tier: write and read >= 0.8 x a plain sequential write and read",
            measured,
            bool(disk.get("met")),
        )
    )
    fork = freed["fork"] or {
        "arena": {"bytes": 0, "child_private_bytes": 0, "fork_ms": 0.0},
        "control": {"child_private_bytes": 0, "fork_ms": 0.0},
    }
    share = (
        fork["arena"]["child_private_bytes"] / fork["arena"]["bytes"]
        if fork["arena"]["bytes"]
        else None
    )
    rows.append(
        (
            f"a fork copies <= {FORK_PRIVATE_MAX:.0%} of the arena",
            f"arena {_gib(fork['arena']['bytes'])}: child private {_gib(fork['arena']['child_private_bytes'])}, "
            f"fork {fork['arena']['fork_ms']:.1f} ms; control (torch pinned): child private "
            f"{_gib(fork['control']['child_private_bytes'])}, fork {fork['control']['fork_ms']:.1f} ms",
            share is not None and share <= FORK_PRIVATE_MAX,
        )
    )
    numa = freed.get("numa") or {}
    rows.append(
        (
            "host arena NUMA node reported",
            f"node {numa.get('numa_node')}, "
            f"{'bound' if numa.get('numa_bound') else 'not bound'} {numa.get('numa_note') or ''}".strip(),
            "numa_node" in numa,
        )
    )
    return rows


def _write(path, fig: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(fig, indent=1, default=str))


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / GIB:.3f} GiB"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.3f}x"


# ------------------------------------------------------------------------------ commands
def measure(args) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print(NEEDS_GPU, file=sys.stderr)
        return 2
    device = init(args.dry_run)
    try:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GIB / total))
        shape = dict(
            hidden=args.hidden, layers=args.layers, seq=args.seq, micro_batch=1, vocab=args.vocab
        )
        started = time.perf_counter()
        fig = {"cap_gib": args.cap_gib, "shape": shape, "dry_run": args.dry_run, "skipped": []}
        parts = (
            ("freed", lambda: freed_figure(device, shape)),
            ("checkpoint", lambda: checkpoint_figure(device, shape)),
            ("disk_tier", lambda: disk_tier_figure(device, args.dry_run)),
            ("micro_batch", lambda: micro_batch_figure(device, shape, args.max_micro_batch)),
            ("width", lambda: width_figure(device, shape, args.max_hidden)),
        )
        for name, take in parts:
            # Within the time given (scripts/gpu.sh ends the whole run in ten minutes): a part
            # that would start late is skipped and says so; what was measured is kept.
            if time.perf_counter() - started > args.budget_s:
                fig["skipped"].append(name)
                continue
            fig[name] = take()
            fig["seconds"] = time.perf_counter() - started
            _write(args.json, fig)
    finally:
        shutdown()
    rows = goals(fig)
    fig["goals"] = rows
    _write(args.json, fig)
    for name, measured, met in rows:
        print(f"[{'PASS' if met else 'FAIL'}] {name}: {measured}")
    return 0 if all(met for *_, met in rows) else 1


def collect(work: Path) -> dict:
    """Everything one ``scripts/gpu.sh run`` measured, from the files it left in ``work``."""

    def read(name):
        path = work / name
        return path.read_text().strip() if path.exists() else None

    def load(name):
        text = read(name)
        return json.loads(text) if text else None

    tests_rc = read("tests.rc")
    return {
        "machine": read("machine.txt"),
        "tests_rc": None if tests_rc is None else int(tests_rc),
        "gpu_report": load("gpu_report.json"),
        "kit": load("kit.json"),
    }


def table(results: dict) -> str:
    """results.md: the GPU tests' outcome, every guard of gpu_report and every goal of the kit;
    a part that did not run (or wrote nothing) is a row that is not met."""
    lines = ["# GPU kit results", ""]
    if results.get("machine"):
        lines += ["```", results["machine"], "```", ""]
    lines += ["| figure | measured | met |", "| --- | --- | --- |"]
    rc = results.get("tests_rc")
    lines.append(
        f"| GPU tests (`pytest -m 'gpu or te_gpu' tests/unit`) | exit code {rc} | {'yes' if rc == 0 else 'NO'} |"
    )
    report = results.get("gpu_report")
    if report:
        for label, entry in report.items():
            for name, measured, ok in entry["guards"]:
                lines.append(f"| {label}: {name} | {measured} | {'yes' if ok else 'NO'} |")
    else:
        lines.append(
            "| benchmarks.gpu_report (pretrain example on and off) | wrote no figures | NO |"
        )
    kit = results.get("kit")
    if kit:
        for name, measured, met in kit["goals"]:
            lines.append(f"| {name} | {measured} | {'yes' if met else 'NO'} |")
    else:
        lines.append("| benchmarks.gpu_kit measure | wrote no figures | NO |")
    return "\n".join(line.replace("\n", " ") for line in lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_kit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="take the kit's figures (one GPU)")
    m.add_argument("--dry-run", action="store_true", help="CPU ranks, small sizes, no CUDA figures")
    m.add_argument("--json", metavar="PATH")
    m.add_argument("--cap-gib", type=float, default=24.0, help="device memory the searches may use")
    m.add_argument("--hidden", type=int, default=2048)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--seq", type=int, default=1024)
    m.add_argument("--vocab", type=int, default=32768)
    m.add_argument("--max-micro-batch", type=int, default=64)
    m.add_argument("--max-hidden", type=int, default=8192)
    m.add_argument(
        "--budget-s",
        type=float,
        default=150.0,
        help="no part starts after this many seconds (the searches come last)",
    )
    t = sub.add_parser(
        "table", help="results.md and results.json in OUT from the files a run left in WORK"
    )
    t.add_argument("work")
    t.add_argument("out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "table":
        results = collect(Path(args.work))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (out / "results.md").write_text(table(results))
        print((out / "results.md").read_text())
        return 0
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
