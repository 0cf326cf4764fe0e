"""Session-wide fixtures: pools of CPU rank processes running the real megatron-core.

`rank_pool` (2 ranks) and `rank_pool4` (4 ranks, started only if some test asks for it) live
for the whole session, as does `isolated` (one process for test bodies that might touch released
memory). A test that breaks a pool (a rank dies or hangs) does not spoil the
next one: the pool's next run() starts fresh ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = str(Path(__file__).resolve().parents[1])

# Jobs are module-level functions of test modules; rank processes (and any subprocess) must be
# able to import them and the package under test from the repository root.
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
_pythonpath = os.environ.get("PYTHONPATH", "")
if REPO_ROOT not in _pythonpath.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, _pythonpath) if p)

from tests.harness.isolated import IsolatedProcess  # noqa: E402
from tests.harness.rank_pool import RankPool  # noqa: E402


def _session_pool(world_size: int):
    pool = RankPool(world_size=world_size)
    try:
        pool.start()
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="session")
def isolated():
    """A long-lived separate process for test bodies that might touch released memory."""
    proc = IsolatedProcess()
    yield proc
    proc.close()


@pytest.fixture(scope="session")
def rank_pool():
    """A RankPool of 2 ranks shared by the whole session."""
    yield from _session_pool(2)


@pytest.fixture(scope="module")
def reference_run(rank_pool):
    """``rank_pool.run(job, *args, **kwargs)``, made once per module for the same job and
    arguments: the run without offloading that several tests of a module compare with. Every
    job starts from the same seeds (``seed_everything``), so running it again gives the same
    run."""
    made = {}

    def run(job, *args, **kwargs):
        key = repr((job.__module__, job.__qualname__, args, sorted(kwargs.items())))
        if key not in made:
            made[key] = rank_pool.run(job, *args, **kwargs)
        return made[key]

    return run


@pytest.fixture(scope="session")
def rank_pool4():
    """A RankPool of 4 ranks shared by the whole session (created on first use)."""
    yield from _session_pool(4)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``bridge`` need Megatron-Bridge, tests marked ``verl`` need verl: elsewhere
    they are skipped, and say so."""
    import importlib.util

    for marker, module, environment in (
        ("bridge", "megatron.bridge", "bridge"),
        ("verl", "verl", "verl"),
    ):
        try:
            present = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            present = False
        if present:
            continue
        skip = pytest.mark.skip(
            reason=f"{module} is not in this environment: the `{marker}` tests run in "
            f"scripts/venv.sh {environment} (the README's test command runs them there)"
        )
        for item in items:
            if item.get_closest_marker(marker) is not None:  # the marker, not a test id
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Say how large the correctness matrix was, when it ran."""
    matrix = sys.modules.get("tests.integration.offloader.test_matrix")
    if matrix is None:
        return
    ran = [
        r
        for r in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
        if "test_matrix_offloading_is_bitwise_invisible" in r.nodeid
    ]
    dims = {
        name: sorted({str(case[i]) for case in matrix.CASES})
        for i, name in enumerate(
            (
                "layout",
                "dtype",
                "model",
                "overlap_grad_reduce",
                "overlap_param_gather",
                "bucket_size",
                "micro_batches",
            )
        )
    }
    terminalreporter.write_line(
        f"correctness matrix: {len(matrix.CASES)} cases ({len(ran)} ran) over "
        + "; ".join(f"{k}={'/'.join(v)}" for k, v in dims.items())
    )
