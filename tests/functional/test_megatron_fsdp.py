"""examples/pretrain_gpt.py under Megatron-FSDP (``--use-megatron-fsdp``, its default sharding
strategy ``optim_grads_params``, ``--ckpt-format fsdp_dtensor``) with and without
``--offload-optimizer-states``, on 2 and 4 gloo ranks.

Per iteration, on every rank, lm loss and grad norm are bitwise those of the plain script; with
``--log-params-norm`` megatron.training reads the fp32 master weights after every step (the
masters are offloaded then), and the norm it logs is the plain run's too. After every step the
offloader holds every state and master buffer on the host and nothing on the device.
"""

from __future__ import annotations

import re

import pytest

from tests.functional import runner


def _case(world_size: int) -> runner.Case:
    return runner.Case(
        f"megatron-fsdp-dp{world_size}",
        world_size,
        (
            "--bf16",
            "--use-megatron-fsdp",
            "--ckpt-format",
            "fsdp_dtensor",
            "--log-params-norm",
        ),
        train_iters=4,
        description=f"Megatron-FSDP over {world_size} data-parallel ranks, bf16",
        unset_env=("CUDA_DEVICE_MAX_CONNECTIONS",),
    )


def _values(run, rank):
    return [(e["lm_loss"], e["grad_norm"], e["skipped"]) for e in run.ranks[rank]["iterations"]]


def _params_norms(run) -> list[str]:
    return re.findall(r"params norm: ([0-9.eE+-]+)", run.log)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_stock_script_under_megatron_fsdp_is_bitwise_offloaded(world_size):
    case = _case(world_size)
    on = runner.run(case, offload=True)
    off = runner.run(case, offload=False)
    for rank in range(world_size):
        assert len(on.ranks[rank]["iterations"]) == case.train_iters
        assert _values(on, rank) == _values(off, rank), f"rank {rank}"
        for index, entry in enumerate(on.ranks[rank]["iterations"]):
            stats, where = entry["offloader"], f"rank {rank}, iteration {index + 1}"
            assert stats is not None and stats["is_offloaded"], where
            # The states' shards and the whole master buffers: all on the host, none resident.
            assert stats["offloaded_bytes"] == entry["expected_offload_bytes"] > 0, where
            assert stats["resident_bytes"] == 0 and stats["host_bytes"] >= stats["offloaded_bytes"]
    norms = _params_norms(off)
    assert len(norms) >= 2 and _params_norms(on) == norms  # every log interval
