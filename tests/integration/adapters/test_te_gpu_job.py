"""The GPU test's own job, dry-run on the CPU with the TE double (see ``test_te_gpu.py``).

No GPU is available to CI, so the real-TE test cannot run here; this runs its job function
end to end on the CPU (gloo, CUDA calls redirected, the double injected) so that at least the
test's own logic is known to work before it meets a GPU.
"""

import pytest

from tests.harness.isolated import IsolatedProcess
from tests.unit.adapters.test_te_gpu import STEPS, _assert_bitwise_and_offloaded, _run


@pytest.fixture(scope="module")
def process():
    """One process for every dry run of this module (each run sets up and tears down its own
    process group and model-parallel state)."""
    process = IsolatedProcess(timeout=600)
    yield process
    process.close()


@pytest.mark.parametrize("remainders,moments", [(True, "fp8")])
def test_gpu_job_logic_runs_on_cpu_with_the_double(process, remainders, moments):
    reference = _run(remainders, moments, False, dry_run=True, process=process)
    offloaded = _run(remainders, moments, True, dry_run=True, process=process)
    _assert_bitwise_and_offloaded(reference, offloaded)


def test_gpu_chunked_checkpoint_job_logic_runs_on_cpu_with_the_double(process, tmp_path):
    reference = _run(
        True, "fp8", False, dry_run=True, checkpoint=str(tmp_path / "ref"), process=process
    )
    chunked = _run(
        True,
        "fp8",
        True,
        dry_run=True,
        chunked=0.3,
        checkpoint=str(tmp_path / "off"),
        process=process,
    )
    _assert_bitwise_and_offloaded(reference, chunked)
    # Streamed in several chunks, except at the first step (states created) and at the one
    # right after the load (the loaded states are still on the device for it).
    chunks = [f["update_chunks"] for f in chunked["figures"]]
    assert all(n >= 2 for i, n in enumerate(chunks) if i not in (0, STEPS // 2)), chunks
