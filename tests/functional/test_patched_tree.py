"""The source-tree route: a Megatron tree with patches/ applied trains with
``--offload-optimizer-states`` when its own script is run directly (no launcher, no
``patch_megatron()``), bitwise like the runtime route and the golden values."""

from __future__ import annotations

import pytest

from tests.functional import golden_values, runner
from tests.unit.patches.tree import (
    if_installed_line_has_a_set,
    installed_version,
    matching_set,
    patched_tree,
)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


# Also in the environment of each other megatron-core line with a set in patches/ (marker
# ``line``; patched_tree() applies the installed line's set).
@if_installed_line_has_a_set(pytest.mark.line)
@pytest.mark.parametrize("device", DEVICES)
def test_patched_tree_trains_like_the_runtime_route(device, tmp_path):
    if matching_set() is None:
        pytest.skip(f"no patch set in patches/ for megatron-core {installed_version()}")
    case = runner.CASES["dp2"]
    if device == "cuda" and runner.gpu_count() < case.world_size:
        pytest.fail(f"this test needs {case.world_size} GPUs, found {runner.gpu_count()}")
    tree = patched_tree(tmp_path)
    patched = runner.run(
        case, offload=True, device=device, route="direct", pythonpath_prefix=str(tree)
    )
    reference = runner.run(case, offload=True, device=device)  # launcher route (cached)
    print(f"\npatched tree [{device}]: {patched.seconds:.1f} s")
    for rank in range(case.world_size):
        assert patched.ranks[rank]["megatron_training_file"].startswith(str(tree)), (
            "the patched tree was not the megatron that ran"
        )
        assert _same_values(patched.ranks[rank], reference.ranks[rank]), (
            f"rank {rank}: the patched tree trains differently from the runtime route"
        )
        for entry in patched.ranks[rank]["iterations"]:
            assert entry["offloader"] is not None and entry["offloader"]["is_offloaded"]
    assert [line["iteration"] for line in patched.offload_lines()] == [1, 2, 4]
    # The patched OptimizerConfig's fields reach the offloader's config as the flags do:
    # tests/integration/patches/test_patched_tree_imports.py (in one process).
    # Exact on the platform the golden file was written on; elsewhere loss and grad norm
    # within golden_values.RTOL, and the checkpoint digests left out (with the reason printed).
    golden_values.check(
        golden_values.trajectory(patched),
        case.name,
        device,
        sections=("iterations", "saves_per_rank"),
        required=False,
    )


def _same_values(a, b) -> bool:
    keys = ("lm_loss", "grad_norm", "skipped", "expected_offload_bytes")
    same_iterations = [{k: e[k] for k in keys} for e in a["iterations"]] == [
        {k: e[k] for k in keys} for e in b["iterations"]
    ]
    return same_iterations and a["saves"] == b["saves"]
