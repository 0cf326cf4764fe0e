"""Session-wide fixtures: pools of CPU rank processes running the real megatron-core.

`rank_pool` (2 ranks) and `rank_pool4` (4 ranks, started only if some test asks for it) live
for the whole session. A test that breaks a pool (a rank dies or hangs) does not spoil the
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
_pythonpath = os.environ.get('PYTHONPATH', '')
if REPO_ROOT not in _pythonpath.split(os.pathsep):
    os.environ['PYTHONPATH'] = os.pathsep.join(p for p in (REPO_ROOT, _pythonpath) if p)

from tests.harness.rank_pool import RankPool  # noqa: E402


def _session_pool(world_size: int):
    pool = RankPool(world_size=world_size)
    try:
        pool.start()
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope='session')
def rank_pool():
    """A RankPool of 2 ranks shared by the whole session."""
    yield from _session_pool(2)


@pytest.fixture(scope='session')
def rank_pool4():
    """A RankPool of 4 ranks shared by the whole session (created on first use)."""
    yield from _session_pool(4)
