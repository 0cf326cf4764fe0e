"""A Megatron-LM source tree's own ``pretrain_gpt.py``, through ``python -m
megatron_offload.launch`` with ``--offload-optimizer-states`` and plainly without it: per
iteration, on every rank, lm loss and grad norm bitwise equal, and the optimizer state each
checkpoint save sees equal, as for examples/pretrain_gpt.py (test_pretrain_offload.py).

Set ``MEGATRON_LM_TREE`` to the root of a Megatron-LM checkout (the directory holding
``pretrain_gpt.py``); the tree goes first on ``PYTHONPATH``, before the installed megatron-core,
so the tree's ``megatron`` is the one that trains. Without the variable the test is skipped
with that reason. The tree's dataset helpers are compiled on first use as the tree's own
initialization does it (``make`` needs ``pybind11`` importable). Example (the 0.17 line, whose
wheel ships no ``megatron/legacy``)::

    MEGATRON_LM_TREE=~/Megatron-LM PYTHONPATH=. \\
        $(scripts/venv.sh mcore-0.17)/bin/python -m pytest tests/functional/test_stock_script.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.functional import runner

TREE_ENV = "MEGATRON_LM_TREE"


def _tree() -> Path:
    value = os.environ.get(TREE_ENV)
    if not value:
        pytest.skip(
            f"{TREE_ENV} is not set: point it at a Megatron-LM checkout to train its own "
            "pretrain_gpt.py through the launcher"
        )
    tree = Path(value).expanduser().resolve()
    if not (tree / "pretrain_gpt.py").is_file():
        pytest.fail(f"{TREE_ENV}={value}: no pretrain_gpt.py there (give the checkout root)")
    return tree


@pytest.mark.parametrize("case_name", ["dp2"])
def test_stock_pretrain_gpt_trains_bitwise_like_without_offloading(case_name):
    tree = _tree()
    case = runner.CASES[case_name]
    kwargs = dict(device="cpu", pythonpath_prefix=str(tree), script=tree / "pretrain_gpt.py")
    on = runner.run(case, offload=True, route="launch", **kwargs)
    off = runner.run(case, offload=False, route="direct", **kwargs)
    print(f"\n{tree}: offloading on {on.seconds:.1f} s, off {off.seconds:.1f} s")
    for rank in range(case.world_size):
        # The tree's megatron.training ran, not the installed one.
        assert on.ranks[rank]["megatron_training_file"].startswith(str(tree)), on.ranks[rank]
        values_on = [
            (e["lm_loss"], e["grad_norm"], e["skipped"]) for e in on.ranks[rank]["iterations"]
        ]
        values_off = [
            (e["lm_loss"], e["grad_norm"], e["skipped"]) for e in off.ranks[rank]["iterations"]
        ]
        assert len(values_on) == case.train_iters
        assert values_on == values_off, f"rank {rank}: per-iteration values differ"
        assert on.ranks[rank]["saves"] == off.ranks[rank]["saves"]
        assert [s["iteration"] for s in on.ranks[rank]["saves"]] == [3, 5]
        for entry in on.ranks[rank]["iterations"]:
            stats = entry["offloader"]
            assert stats is not None and stats["is_offloaded"], entry
            assert stats["offloaded_bytes"] == entry["expected_offload_bytes"] > 0, entry
        assert all(e["offloader"] is None for e in off.ranks[rank]["iterations"])
        # Exactly one offloader: never Megatron's own beside ours (Megatron-LM dev reads
        # --offload-optimizer-states as an alias of its chunked offloader).
        assert not any(e["megatron_own_offloader"] for e in on.ranks[rank]["iterations"])
    arguments = (tree / "megatron" / "training" / "arguments.py").read_text()
    if "--chunked-optimizer-state-offload" in arguments:
        said = "megatron-offload's offloader is active and Megatron's own chunked"
        assert on.log.count(said) == 1, on.log[-3000:]
    last = on.ranks[-1]["iterations"]
    print(
        f"{tree}: lm loss per iteration "
        + ", ".join(repr(float.fromhex(e["lm_loss"])) for e in last)
    )


def test_the_trees_optimizers_keep_the_state_access_contract():
    """The tree's megatron-core optimizers: every method that touches states or masters is
    served, routed or shown safe (tests/unit/access/test_state_contract.py, for the tree)."""
    tree = _tree()
    check = (
        "import sys, megatron.core.optimizer as o\n"
        "assert o.__file__.startswith(sys.argv[1]), o.__file__\n"
        "from tests.harness.state_contract import unclassified\n"
        "found = unclassified()\n"
        "assert found == {}, found\n"
        "print('CONTRACT OK')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check, str(tree)],
        env=runner.environment("cpu", str(tree)),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(runner.REPO),
    )
    assert result.returncode == 0 and "CONTRACT OK" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
