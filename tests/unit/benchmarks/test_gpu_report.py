"""``benchmarks.gpu_report`` on CPU: parsing, figures, guards, report, exit codes, commands.

The report itself needs a GPU. Everything it computes is checked here on logs: synthetic
ones whose copy figures come from the modelled device (``benchmarks.modelled_gpu``: bytes,
the time until the state's memory is reusable, allocator stalls), and the real output of
``benchmarks.gpu_report_job`` around the pretrain example on one CPU rank (gloo), where the
memory figures are absent and the memory guard must therefore fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_report as gr
from benchmarks import gpu_report_job as job
from benchmarks import modelled_gpu

REPO = Path(__file__).resolve().parents[3]
GB = modelled_gpu.GB
ITERS, WARMUP = 8, 3


@pytest.fixture(scope="module")
def modelled():
    """Offload of a 2 GB state at 25 GB/s on the allocator model, as pieces and as one block."""
    return {
        layout: modelled_gpu.measure(layout, 25 * GB, state_bytes=2 * GB, tensors=20)
        for layout in ("pieces", "one block")
    }


def _offload_line(it, stats, ranks):
    from megatron_offload.report import human_bytes

    scope = f" (max over {ranks} ranks)" if ranks > 1 else ""
    return (
        f" [optimizer-state offload] iteration {it:8d} | offloaded: {human_bytes(stats['offloaded_bytes'])} |"
        f" host: {human_bytes(stats['host_bytes'])} | D2H: {stats['d2h_ms']:.3f} ms ({stats['d2h_gbps']:.2f} GB/s) |"
        f" H2D: {stats['h2d_ms']:.3f} ms ({stats['h2d_gbps']:.2f} GB/s) | exposed: {stats['exposed_ms']:.3f} ms |"
        f" issue: 0.412 ms |{scope}"
    )


def synthetic_log(
    tmp_path,
    row,
    *,
    offload,
    world=2,
    bench_factor=1.0,
    freed_factor=1.0,
    retries_after_warmup=0,
    flip=None,
    drop_iteration=None,
    step_s=0.5,
    name="log",
):
    """A run's log: noise, the job's lines (written by ``job.emit``) and the offloader's lines.

    Copy figures from the modelled ``row``: bytes, and the time until all of the state's
    memory was reusable as the D2H (and H2D) time; the copy benchmark runs at the modelled
    link speed times ``bench_factor``. ``retries_after_warmup`` allocator retries per judged
    iteration; ``flip``: (rank, iteration) whose lm loss differs in its last bit."""
    nbytes = row["bytes"]
    ms = row["full_s"] * 1e3
    path = tmp_path / f"{name}.{'on' if offload else 'off'}.raw"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(
            fd,
            b"W0101 torch/distributed/run.py] Setting OMP_NUM_THREADS\n> building mock GPT datasets ...\n",
        )
        for it in range(1, ITERS + 1):
            if it == drop_iteration:
                continue
            for rank in range(world):
                state = nbytes // world
                stats = None
                if offload:
                    stats = {
                        "offloaded_bytes": state,
                        "offloaded_payload_bytes": state,
                        "host_bytes": state,
                        "d2h_bytes": state,
                        "h2d_bytes": state,
                        "d2h_ms": ms / world,
                        "h2d_ms": ms / world,
                        "d2h_gbps": state / (ms / world * 1e6),
                        "h2d_gbps": state / (ms / world * 1e6),
                        "exposed_ms": 1.5,
                        "offload_seconds": 0.001,
                        "reload_seconds": 0.001,
                    }
                retries = max(0, it - WARMUP) * retries_after_warmup + (
                    1 if it >= 2 else 0
                )  # one warm-up retry
                loss = 4.5 - it * 0.01
                if flip == (rank, it) and offload:
                    loss = float.fromhex(loss.hex()) + 2**-50
                grads = state // 3
                job.emit(
                    {
                        "kind": "iteration",
                        "rank": rank,
                        "world_size": world,
                        "offload": offload,
                        "iteration": it,
                        "t_entry": it * step_s * (1.1 if offload else 1.0),
                        "t_exit": it * step_s * (1.1 if offload else 1.0) + 0.3,
                        "allocated_entry": (3 * state if offload else 3 * state + state + grads),
                        "max_allocated": 6 * state,
                        "reserved": 7 * state,
                        "alloc_retries": retries if offload else 0,
                        "allocated_exit": 3 * state,
                        "lm_loss": loss.hex(),
                        "grad_norm": (1.0 + it).hex(),
                        "skipped": 0,
                        "state_bytes": state,
                        "offload_calls": 1 if offload else 0,
                        "freed": int((state + grads) * freed_factor) if offload else None,
                        "expected_freed": state + grads if offload else None,
                        "stats": stats,
                    },
                    fd,
                )
            if offload:
                os.write(fd, (_offload_line(it, stats, world) + "\n").encode())
        for rank in range(world):
            if offload:
                bench_ms = row["floor_s"] * 1e3 / world / bench_factor
                job.emit(
                    {
                        "kind": "copy_bench",
                        "rank": rank,
                        "repeats": 5,
                        "d2h_bytes": nbytes // world,
                        "h2d_bytes": nbytes // world,
                        "d2h_ms": bench_ms,
                        "h2d_ms": bench_ms,
                        "d2h_gbps": nbytes // world / (bench_ms * 1e6),
                        "h2d_gbps": nbytes // world / (bench_ms * 1e6),
                    },
                    fd,
                )
    finally:
        os.close(fd)
    return path.read_text()


def _figures(tmp_path, row, **kwargs):
    on = synthetic_log(tmp_path, row, offload=True, **kwargs)
    off = synthetic_log(
        tmp_path, row, offload=False, **{k: v for k, v in kwargs.items() if k == "drop_iteration"}
    )
    fig = gr.run_figures(on, off, WARMUP)
    return fig, {name: ok for name, _, ok in gr.guards(fig)}


def _guard(rows, prefix):
    (ok,) = [ok for name, ok in rows.items() if name.startswith(prefix)]
    return ok


# ------------------------------------------------------------------------------ parsing
def test_offload_line_of_the_new_format_is_parsed_with_and_without_the_rank_scope():
    stats = {
        "offloaded_bytes": 3 << 30,
        "host_bytes": 3 << 30,
        "d2h_ms": 120.5,
        "d2h_gbps": 26.73,
        "h2d_ms": 98.25,
        "h2d_gbps": 32.78,
        "exposed_ms": 4.125,
    }
    log = "noise\n" + _offload_line(7, stats, 8) + "\nmore\n" + _offload_line(8, stats, 1) + "\n"
    rows = gr.parse_offload_lines(log)
    assert [r["iteration"] for r in rows] == [7, 8]
    assert [r["ranks"] for r in rows] == [8, 1]
    assert (
        rows[0]["offloaded_gib"] == 3.0
        and rows[0]["d2h_ms"] == 120.5
        and rows[0]["d2h_gbps"] == 26.73
    )
    assert (
        rows[0]["h2d_gbps"] == 32.78
        and rows[0]["exposed_ms"] == 4.125
        and rows[0]["issue_ms"] == 0.412
    )
    old = (
        " [optimizer-state offload] iteration        2 | offloaded: 0.000617 GiB | host: 0.000617 GiB |"
        " D2H: 0.717 ms | H2D: 1.021 ms | (max over 2 ranks)"
    )
    assert gr.parse_offload_lines(old) == []
    noted = _offload_line(9, stats, 4).replace(
        "(max over 4 ranks)", "(max over 4 ranks; GB/s: min)"
    )
    assert [(r["iteration"], r["ranks"]) for r in gr.parse_offload_lines(noted)] == [(9, 4)]


def test_job_lines_are_parsed_per_rank_among_other_output(tmp_path, modelled):
    log = synthetic_log(tmp_path, modelled["pieces"], offload=True, world=2)
    parsed = gr.parse_job_lines(log + "[rank1]: some traceback line\n")
    assert sorted(parsed["iterations"]) == [0, 1]
    assert [r["iteration"] for r in parsed["iterations"][1]] == list(range(1, ITERS + 1))
    assert parsed["copy_bench"][0]["d2h_bytes"] == modelled["pieces"]["bytes"] // 2


# ---------------------------------------------------------------- figures and each guard
def test_modelled_pieces_pass_every_guard_and_figures_follow_the_model(tmp_path, modelled):
    row = modelled["pieces"]
    assert row["stalls"] == 0
    fig, rows = _figures(tmp_path, row)
    assert all(rows.values()), rows
    rank = fig["ranks"][0]
    assert rank["d2h_gbps"] == pytest.approx(row["bytes"] / row["full_s"] / 1e9, rel=1e-9)
    assert rank["d2h_gbps"] / rank["bench"]["d2h_gbps"] == pytest.approx(
        1 / row["full_ratio"], rel=1e-9
    )
    assert (
        rank["between_steps_off"] - rank["between_steps_on"]
        == row["bytes"] // 2 + row["bytes"] // 2 // 3
    )
    assert fig["overhead_pct"] == pytest.approx(10.0)
    assert rank["step_on"] == pytest.approx(0.55) and rank["step_off"] == pytest.approx(0.5)


def test_memory_guard_fails_when_the_allocator_did_not_get_the_memory_back(tmp_path, modelled):
    _, rows = _figures(tmp_path, modelled["pieces"], freed_factor=0.5)
    assert not _guard(rows, "memory freed")
    assert _guard(rows, "offload bandwidth") and _guard(rows, "lm loss")


def test_retries_guard_fails_with_the_stalls_of_one_storage_per_group(tmp_path, modelled):
    block = modelled["one block"]
    assert block["stalls"] >= 1  # the model's stall path, once per offload
    _, rows = _figures(tmp_path, block, retries_after_warmup=block["stalls"])
    assert not _guard(rows, "num_alloc_retries")
    _, rows = _figures(tmp_path, block, retries_after_warmup=0)  # warm-up retries are not judged
    assert _guard(rows, "num_alloc_retries")


@pytest.mark.parametrize("factor, held", [(1.0 / 0.71, True), (1.0 / 0.69, False)])
def test_bandwidth_guard_at_0_7_of_the_copy_benchmark(tmp_path, modelled, factor, held):
    _, rows = _figures(tmp_path, modelled["pieces"], bench_factor=factor)
    assert _guard(rows, "offload bandwidth") is held


def test_loss_guard_fails_on_one_bit_and_on_a_missing_iteration(tmp_path, modelled):
    _, rows = _figures(tmp_path, modelled["pieces"], flip=(1, ITERS))
    assert not _guard(rows, "lm loss")
    fig, rows = _figures(tmp_path, modelled["pieces"])
    fig["ranks"][0]["losses_off"].pop(2)
    assert not {name: ok for name, _, ok in gr.guards(fig)}[
        "lm loss and grad norm bitwise equal on and off"
    ]


def test_runs_with_no_figures_fail_every_guard():
    fig = gr.run_figures("no job lines here", "nor here", WARMUP)
    rows = gr.guards(fig)
    assert rows and not any(ok for _, _, ok in rows)
    assert gr.exit_status(rows, []) == 1


def test_report_text_and_exit_status(tmp_path, modelled):
    fig, _ = _figures(tmp_path, modelled["pieces"])
    rows = gr.guards(fig)
    text = gr.format_report("2 GPUs", fig, rows)
    assert "overhead +10.0%" in text
    assert "D2H: " in text and "GB/s; pinned copy_" in text
    assert f"over 2 rank(s)), iteration {ITERS}" in text
    assert text.count("[PASS]") == len(rows) and "[FAIL]" not in text
    assert gr.exit_status(rows, []) == 0
    assert gr.exit_status(rows, ["1 GPU, offloading on: exit code 1"]) == 1
    failing = rows[:-1] + [(rows[-1][0], rows[-1][1], False)]
    assert gr.exit_status(failing, []) == 1


@pytest.mark.parametrize("bench_factor, status", [(1.0, 0), (2.0, 1)])
def test_main_on_saved_logs_exits_by_the_guards(tmp_path, modelled, capsys, bench_factor, status):
    logs = tmp_path / "logs"
    logs.mkdir()
    for world in (1, 4):
        for offload in (True, False):
            text = synthetic_log(
                tmp_path,
                modelled["pieces"],
                offload=offload,
                world=world,
                bench_factor=bench_factor if offload else 1.0,
            )
            (logs / gr._log_name(world, offload)).write_text(text)
    out_json = tmp_path / "figures.json"
    assert (
        gr.main(["--from-logs", str(logs), "--warmup", str(WARMUP), "--json", str(out_json)])
        == status
    )
    out = capsys.readouterr().out
    assert "== 1 GPU: 1 rank(s)" in out and "== 4 GPUs: 4 rank(s)" in out
    assert ("all guards held" in out) is (status == 0)
    assert set(json.loads(out_json.read_text())) == {"1 GPU", "4 GPUs"}


# ----------------------------------------------------------------------------- commands
def test_commands_one_gpu_plain_several_with_torchrun():
    args = gr.parse_args(
        ["--micro-batch", "2", "--micro-batches", "3", "--megatron-args=--deterministic-mode"]
    )
    flags = gr.megatron_flags(args, 4)
    assert flags[flags.index("--global-batch-size") + 1] == "24"
    assert flags[flags.index("--distributed-backend") + 1] == "nccl"
    assert flags[-1] == "--deterministic-mode" and "--use-distributed-optimizer" in flags
    one_on = gr.command(1, True, ["--x"], python="py")
    assert one_on == [
        "py",
        "-m",
        "benchmarks.gpu_report_job",
        "launch",
        str(gr.EXAMPLE),
        "--x",
        "--offload-optimizer-states",
    ]
    assert gr.command(1, False, ["--x"], python="py") == [
        "py",
        "-m",
        "benchmarks.gpu_report_job",
        "direct",
        str(gr.EXAMPLE),
        "--x",
    ]
    several = gr.command(8, True, ["--x"], python="py")
    assert several[:5] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=8",
    ]
    assert several[5:8] == ["-m", "benchmarks.gpu_report_job", "launch"]
    assert gr.configurations(1) == [1] and gr.configurations(8) == [1, 8]
    assert gr.environment({"PYTHONPATH": "/x"})["PYTHONPATH"] == os.pathsep.join([str(REPO), "/x"])
    # Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1: its runs go without it.
    assert gr.environment({})["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in gr.environment({}, megatron_fsdp=True)


def test_without_a_gpu_the_report_exits_2_and_says_so():
    # The report's process sees no GPU, on a machine with one too.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_report"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "needs a CUDA GPU" in proc.stderr
    assert "all guards held" not in proc.stdout


# --------------------------------------------------------------------------- the job
class _FakeOffloader:
    """Frees ``released`` bytes of a fake allocator per offload, as the real one's stats say,
    calling its offload hooks around it as the real one does."""

    def __init__(self, probe, released):
        self.probe, self.released, self.payload = probe, released, 0
        self.config = SimpleNamespace(release_master_grads=True)
        self.hooks = {"pre": [], "post": []}

    def register_offload_pre_hook(self, hook):
        self.hooks["pre"].append(hook)

    def register_offload_post_hook(self, hook):
        self.hooks["post"].append(hook)

    def stats(self):
        return {
            "offloaded_payload_bytes": self.payload,
            "offloaded_bytes": self.payload,
            "d2h_gbps": 12.5,
        }

    def _offload(self, selection, *, skip_unchanged=False):
        for hook in self.hooks["pre"]:
            hook(self)
        self.probe.bytes -= self.released
        self.payload = self.released
        for hook in self.hooks["post"]:
            hook(self)


class _FakeProbe(job.Probe):
    def __init__(self):
        super().__init__(cuda=False)
        self.bytes = 10_000

    def allocated(self):
        return self.bytes


def test_recorder_measures_each_offload_and_emits_one_line_per_iteration():
    master = torch.zeros(10)
    master.grad = torch.zeros(10)
    param = torch.zeros(10, requires_grad=True)
    inner = torch.optim.Adam([param])
    param.grad = torch.ones(10)
    inner.step()  # two fp32 moments of 10 elements
    probe = _FakeProbe()
    dopt = SimpleNamespace(optimizer=inner, shard_fp32_from_float16_groups=[[master]])
    dopt._state_offloader = _FakeOffloader(probe, released=120)
    lines = []
    recorder = job.IterationRecorder(
        offload=True, probe=probe, rank=3, world_size=4, emit=lines.append
    )

    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
        optimizer._state_offloader._offload([("optimizer_states",)])
        return {"lm loss": torch.tensor(2.5)}, 0, False, False, 0, 0.75, None

    wrapped = recorder.wrap_train_step(train_step)
    for _ in range(2):
        wrapped(None, None, None, dopt, None, None)
    assert [line["iteration"] for line in lines] == [1, 2] and lines[0]["rank"] == 3
    first = lines[0]
    assert first["freed"] == 120 and first["offload_calls"] == 1
    assert first["expected_freed"] == 120 + 40  # released payload + the master's fp32 grad
    assert first["state_bytes"] == 2 * 40 + 40  # two moments and the master
    assert first["lm_loss"] == (2.5).hex() and first["grad_norm"] == (0.75).hex()
    assert first["stats"]["d2h_gbps"] == 12.5 and first["stats"]["exposed_ms"] is None
    assert lines[1]["expected_freed"] == 40  # nothing newly released: only the grad is expected
    assert lines[1]["t_entry"] >= first["t_exit"]
