"""The GPU report's job on CPU ranks: the real example pretrain script recorded through the report's job, and the guards on its figures."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks import gpu_report as gr
from megatron_offload_testing.pretrain_flags import gpt_flags
from tests.unit.benchmarks.test_gpu_report import _guard  # noqa: F401


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """The job around the pretrain example on one CPU rank (gloo), offloading on and off."""
    flags = [
        *gpt_flags(),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-3",
        "--seed",
        "1234",
        "--bf16",
        "--log-interval",
        "1",
        "--train-iters",
        "5",
        "--distributed-backend",
        "gloo",
    ]
    env = gr.environment(dict(os.environ, CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo"))
    env.pop("RANK", None)
    logs = {}
    for offload in (True, False):
        proc = subprocess.run(
            gr.command(1, offload, flags),
            cwd=tmp_path_factory.mktemp("job"),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-4000:]
        logs[offload] = proc.stdout
    return logs


def test_job_on_cpu_ranks_records_the_real_example(cpu_runs):
    on = gr.parse_job_lines(cpu_runs[True])
    off = gr.parse_job_lines(cpu_runs[False])
    assert list(on["iterations"]) == [0] and list(off["iterations"]) == [0]
    records_on, records_off = on["iterations"][0], off["iterations"][0]
    assert (
        [r["iteration"] for r in records_on]
        == [1, 2, 3, 4, 5]
        == [r["iteration"] for r in records_off]
    )
    for r in records_on:
        assert r["offload"] and r["offload_calls"] == 1
        assert r["stats"]["offloaded_payload_bytes"] == r["state_bytes"] > 0
        # bf16 with fp32 masters and Adam: moments 8 B + master 4 B per element; its grad 4 B
        assert r["expected_freed"] == r["state_bytes"] + r["state_bytes"] // 3
        assert r["freed"] is None and r["alloc_retries"] is None  # no CUDA: no memory figures
    assert all(r["stats"] is None and r["offload_calls"] == 0 for r in records_off)
    assert [(r["lm_loss"], r["grad_norm"]) for r in records_on] == [
        (r["lm_loss"], r["grad_norm"]) for r in records_off
    ]
    assert on["copy_bench"][0]["skipped"] == "no CUDA device"
    # The offloader's own line, one per iteration (--log-interval 1), agrees with its stats.
    lines = gr.parse_offload_lines(cpu_runs[True])
    assert [line["iteration"] for line in lines] == [1, 2, 3, 4, 5]
    assert gr.parse_offload_lines(cpu_runs[False]) == []
    for line, record in zip(lines, records_on):
        assert line["d2h_ms"] == round(record["stats"]["d2h_ms"], 3)
        assert line["h2d_gbps"] == round(record["stats"]["h2d_gbps"], 2)


def test_guards_on_the_cpu_run_hold_for_losses_and_fail_without_memory_figures(cpu_runs):
    fig = gr.run_figures(cpu_runs[True], cpu_runs[False], warmup=2)
    rows = {name: ok for name, _, ok in gr.guards(fig)}
    assert rows["every rank logged every iteration on and off, beyond the warm-up"]
    assert rows["lm loss and grad norm bitwise equal on and off"]
    assert not _guard(rows, "memory freed") and not _guard(rows, "num_alloc_retries")
    assert not _guard(rows, "offload bandwidth")
    assert gr.exit_status(list(gr.guards(fig)), []) == 1
