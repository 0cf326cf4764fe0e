"""The GPU kit (``scripts/gpu.sh``, ``benchmarks.gpu_kit``) where no GPU exists: it says so and
measures nothing; its measuring logic runs end to end on a CPU rank (``--dry-run``)."""

from __future__ import annotations

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


def test_goals_of_parts_not_measured_are_not_met():
    rows = gpu_kit.goals({"skipped": ["width"]})
    assert rows[0] == (
        "every figure measured",
        "not measured: freed, checkpoint, disk_tier, micro_batch, width",
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
