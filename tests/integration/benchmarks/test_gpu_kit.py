"""The GPU kit's measurements, end to end on a CPU rank (--dry-run): every part runs and reports."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import gpu_kit
from tests.unit.benchmarks.test_gpu_kit import REPO, _env  # noqa: F401


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
    disk = fig["disk_tier"]  # measured on the CPU too: the disk is this machine's
    assert disk["bitwise"] and disk["held"]["page_cache_after_offload"] == 0, disk
    assert len(met) == 8 and not met["offload() frees >= 0.99 x 12 B/param of the shard"]
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
