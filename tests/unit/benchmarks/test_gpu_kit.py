"""The GPU kit (``scripts/gpu.sh``, ``benchmarks.gpu_kit``) where no GPU exists: it says so and
measures nothing; its measuring logic runs end to end on a CPU rank (``--dry-run``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_kit

REPO = Path(__file__).resolve().parents[3]
HAVE_CUDA = torch.cuda.is_available()


def _env() -> dict:
    # python3 is this interpreter (torch importable, no CUDA): the branch a GPU-less machine takes.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.skipif(
    HAVE_CUDA, reason="this machine has a CUDA GPU: scripts/gpu.sh run would measure"
)
def test_gpu_sh_run_without_a_gpu_exits_2_and_writes_nothing(tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        ["bash", "scripts/gpu.sh", "run", str(out)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU here" in proc.stderr and "nothing was measured" in proc.stderr
    assert not out.exists()


def test_gpu_sh_without_a_command_prints_its_usage():
    proc = subprocess.run(
        ["bash", "scripts/gpu.sh"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "usage: scripts/gpu.sh prepare | run [OUT]" in proc.stderr


@pytest.mark.skipif(HAVE_CUDA, reason="this machine has a CUDA GPU")
def test_measure_without_a_gpu_exits_2():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kit", "measure"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and gpu_kit.NEEDS_GPU in proc.stderr


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 5, 7, 8, 13, 64, 100])
def test_largest_finds_the_largest_fitting_multiple_within_the_limit(threshold):
    tried = []

    def fits(value):
        tried.append(value)
        return value <= threshold

    found = gpu_kit.largest(fits, 1, 1, 64)
    assert found == min(threshold, 64)
    assert all(1 <= v <= 64 for v in tried) and len(tried) <= 14


def test_largest_in_units_never_passes_the_limit():
    tried = []
    found = gpu_kit.largest(lambda h: tried.append(h) or h <= 3000, 1024, 256, 4096)
    assert found == 2816 and all(t <= 4096 and t % 256 == 0 for t in tried)
    assert gpu_kit.largest(lambda h: True, 1024, 256, 1500) == 1280


def test_the_kit_measures_end_to_end_on_a_cpu_rank(tmp_path):
    """``measure --dry-run``: every model is built, trained, searched, saved and forked on a
    CPU rank; figures only CUDA gives are None and their goals are not met (exit 1); the
    table then lists every part, a part that wrote nothing as not met."""
    kit = tmp_path / "kit.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_kit",
            "measure",
            "--dry-run",
            "--json",
            str(kit),
            "--hidden",
            "64",
            "--layers",
            "2",
            "--seq",
            "16",
            "--vocab",
            "128",
            "--max-micro-batch",
            "2",
            "--max-hidden",
            "128",
        ],
        cwd=REPO,
        env={**_env(), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    fig = json.loads(kit.read_text())
    freed = fig["freed"]
    assert freed["freed"] is None and freed["expected"] == 12 * freed["params_per_shard"] > 0
    assert fig["micro_batch"]["on"] == fig["micro_batch"]["off"] == 2  # nothing runs out on CPU
    assert fig["width"]["on"] == fig["width"]["off"] == 128
    assert (
        fig["checkpoint"]["on"] > 0
        and fig["checkpoint"]["off"] > 0
        and fig["checkpoint"]["still_offloaded"]
    )
    fork = freed["fork"]
    assert (
        fork["arena"]["bytes"] > 0
        and fork["arena"]["child_private_bytes"] <= 0.01 * fork["arena"]["bytes"]
    )
    assert freed["numa"]["numa_node"] == -1
    met = {name: ok for name, _, ok in fig["goals"]}
    assert len(met) == 7 and not met["offload() frees >= 0.99 x 12 B/param of the shard"]
    assert met["a fork copies <= 1% of the arena"]

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "kit.json").write_text(kit.read_text())
    (work / "tests.rc").write_text("0\n")
    assert gpu_kit.main(["table", str(work), str(out)]) == 0
    table = (out / "results.md").read_text()
    assert "| GPU tests (`pytest -m 'gpu or te_gpu' tests/unit`) | exit code 0 | yes |" in table
    assert (
        "| benchmarks.gpu_report (pretrain example on and off) | wrote no figures | NO |" in table
    )
    assert table.count("| NO |") == 1 + sum(not ok for ok in met.values())
    assert json.loads((out / "results.json").read_text())["kit"]["goals"] == fig["goals"]


def test_goals_of_parts_not_measured_are_not_met():
    rows = gpu_kit.goals({"skipped": ["width"]})
    assert rows[0] == (
        "every figure measured",
        "not measured: freed, checkpoint, micro_batch, width",
        False,
    )
    assert not any(ok for *_, ok in rows)


@pytest.mark.parametrize(
    "error, fits",
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (
            RuntimeError(
                "NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO): out of memory"
            ),
            False,
        ),
        (RuntimeError("shape mismatch"), None),
    ],
)
def test_a_trial_that_runs_out_of_memory_does_not_fit_and_any_other_error_is_raised(
    monkeypatch, error, fits
):
    class Failing:
        def __init__(self, *args, **kwargs):
            raise error

    monkeypatch.setattr(gpu_kit, "Trial", Failing)
    if fits is None:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            gpu_kit._trains(torch.device("cpu"), True, hidden=64)
    else:
        assert gpu_kit._trains(torch.device("cpu"), True, hidden=64) is None
