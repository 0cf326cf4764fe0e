"""The real verl (0.9.1, in ``scripts/venv.sh verl``): its own ``offload_megatron_optimizer``
and ``load_megatron_optimizer``, and its model moves ``offload_megatron_model_to_cpu`` /
``load_megatron_model_to_gpu``, in verl's phase order on real megatron-core (2 gloo ranks),
through the adapter: every tracked byte offloaded at every phase, the model asleep (0 bytes
of parameters and gradients, the parameters rebuilt from the masters) after each model
offload, training bitwise equal to verl's phases without offloading; without the adapter,
verl's model moves copy the parameters and nothing sleeps (negative control; its offload at
engine init walks the state mapping, which brings the masters attach sent out back). On CPU
ranks verl's pinned host copy is a plain one
(``megatron_offload_testing.cpu_megatron.plain_pinning``).

verl's ``MegatronEngine`` itself is not built here: it needs a Hugging Face model
configuration and weights for its model (``mbridge``), which a CPU machine without network
cannot load; its train-mode switches call the two functions by name, as the job does.
"""

import pytest

from tests.harness.compare import assert_bitwise_equal
from tests.integration.frameworks.test_rl_phases import (
    _MODEL_OUT,
    _all_offloaded,
    verl_job,
)

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def shared_dir(rank_pool, tmp_path_factory):
    return str(tmp_path_factory.mktemp("verl-real"))


def test_verl_own_moves_delegate_and_train_bitwise(rank_pool, shared_dir):
    import verl

    assert verl.__version__ == "0.9.1"
    reference = rank_pool.run(verl_job, "reference", f"{shared_dir}/reference", True)
    adapted = rank_pool.run(verl_job, "adapted", f"{shared_dir}/adapted", True)
    assert_bitwise_equal(reference, adapted)
    for rank in adapted:
        assert _all_offloaded(rank) == [], rank["phases"]
        asleep = [f for name, f in rank["phases"] if name in _MODEL_OUT]
        assert asleep and all(f["parameters"] == f["gradients"] == 0 for f in asleep)
        assert any(f["rebuilt"] for f in asleep), rank["phases"]
    unadapted = rank_pool.run(verl_job, "unadapted", f"{shared_dir}/unadapted", True)
    for rank in unadapted:
        assert all(f["sleeps"] == 0 for _, f in rank["phases"]), rank["phases"]
        # verl's own offload at engine init walks the state mapping, which brings back the
        # masters attach sent out (before the first step, the only tensors).
        name, init = rank["phases"][0]
        assert name == "engine init (offload)" and init["offloaded"] == 0 < init["tracked"]
