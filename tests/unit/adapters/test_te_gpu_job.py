"""The GPU test's own job, dry-run on the CPU with the TE double (see ``test_te_gpu.py``).

No GPU is available to CI, so the real-TE test cannot run here; this runs its job function
end to end on the CPU (gloo, CUDA calls redirected, the double injected) so that at least the
test's own logic is known to work before it meets a GPU.
"""

import pytest

from .test_te_gpu import _assert_bitwise_and_offloaded, _run


@pytest.mark.parametrize("remainders,moments", [(True, "fp8")])
def test_gpu_job_logic_runs_on_cpu_with_the_double(remainders, moments):
    reference = _run(remainders, moments, False, dry_run=True)
    offloaded = _run(remainders, moments, True, dry_run=True)
    _assert_bitwise_and_offloaded(reference, offloaded)
