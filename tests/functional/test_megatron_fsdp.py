"""examples/pretrain_gpt.py under Megatron-FSDP (``--use-megatron-fsdp``, its default sharding
strategy ``optim_grads_params``, ``--ckpt-format fsdp_dtensor``) with and without
``--offload-optimizer-states``, on 2 gloo ranks (4 ranks, the four sharding strategies and
uneven shards are the integration tier's: tests/integration/offloader/test_megatron_fsdp.py).

Per iteration, on every rank, lm loss and grad norm are bitwise those of the plain script; with
``--log-params-norm`` megatron.training reads the fp32 master weights after every step (the
masters are offloaded then), and the norm it logs is the plain run's too. After every step the
offloader holds every state and master buffer on the host and nothing on the device.

Both runs also save fsdp_dtensor checkpoints (after iterations 2 and 4): the
offloaded run's hold bit for bit the plain run's tensors, and a run resumed with offloading from
the offloaded run's first one trains on bitwise as the run that never stopped.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import pytest
import torch

from tests.functional import runner
from tests.harness.checkpoints import torch_dist_tensors

SAVE_INTERVAL = 2


def _case() -> runner.Case:
    return runner.Case(
        "megatron-fsdp-dp2",
        2,
        (
            "--bf16",
            "--use-megatron-fsdp",
            "--ckpt-format",
            "fsdp_dtensor",
            "--log-params-norm",
            # Gated linear units: their fc1 states and masters are re-wrapped in halves for
            # the checkpoints (megatron-core's handle_swiglu_in_state_dict).
            "--swiglu",
        ),
        train_iters=4,
        description="Megatron-FSDP over 2 data-parallel ranks, bf16",
        unset_env=("CUDA_DEVICE_MAX_CONNECTIONS",),
        save_interval=SAVE_INTERVAL,
    )


def _values(run, rank):
    return [(e["lm_loss"], e["grad_norm"], e["skipped"]) for e in run.ranks[rank]["iterations"]]


def _params_norms(run) -> list[str]:
    return re.findall(r"params norm: ([0-9.eE+-]+)", run.log)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(offloaded run, plain run, the directory under which they saved)."""
    root = str(tmp_path_factory.mktemp("megatron_fsdp"))
    case = _case()
    on = runner.run(case, offload=True, save_dir=os.path.join(root, "on"))
    off = runner.run(case, offload=False, save_dir=os.path.join(root, "off"))
    return on, off, root


def test_the_stock_script_under_megatron_fsdp_is_bitwise_offloaded(saved):
    case = _case()
    on, off, _ = saved
    for rank in range(2):
        assert len(on.ranks[rank]["iterations"]) == case.train_iters
        assert _values(on, rank) == _values(off, rank), f"rank {rank}"
        for index, entry in enumerate(on.ranks[rank]["iterations"]):
            stats, where = entry["offloader"], f"rank {rank}, iteration {index + 1}"
            assert stats is not None and stats["is_offloaded"], where
            # The states' shards and the whole master buffers: all on the host, none resident.
            assert stats["offloaded_bytes"] == entry["expected_offload_bytes"] > 0, where
            assert stats["resident_bytes"] == 0 and stats["host_bytes"] >= stats["offloaded_bytes"]
            # Nor as any iteration starts, the first included: the main weight buffers exist
            # from the model's construction and went out at attach.
            assert entry["held_at_start"] == 0, where
        # The measure sees the buffers where they are never offloaded.
        assert all(e["held_at_start"] > 0 for e in off.ranks[rank]["iterations"])
    norms = _params_norms(off)
    assert len(norms) >= 2 and _params_norms(on) == norms  # every log interval


def test_its_fsdp_dtensor_checkpoints_hold_the_plain_runs_tensors(saved):
    on, off, root = saved
    for rank in range(2):
        assert [s["iteration"] for s in on.ranks[rank]["saves"]] == [2, 4]
        # Written from the host copy: no byte of states or masters on the device before, while
        # torch DCP writes (the SwiGLU halves included) or after; the plain run's are there.
        for save in on.ranks[rank]["save_storage_bytes"]:
            assert save["before"] == save["after"] == 0, save
            assert save["written_device_bytes"] == [0], save
        for save in off.ranks[rank]["save_storage_bytes"]:
            assert save["written_device_bytes"][0] > 0, save
    for iteration in (SAVE_INTERVAL, 2 * SAVE_INTERVAL):
        name = f"iter_{iteration:07d}"
        written, expected = (
            torch_dist_tensors(os.path.join(root, side, name), os.path.join(root, f"{side}.pt"))
            for side in ("on", "off")
        )
        assert written.keys() == expected.keys()
        assert any("exp_avg_sq" in key for key in written), list(written)
        for key, value in expected.items():
            assert torch.equal(value, written[key]), (iteration, key)


def test_a_resume_from_its_checkpoint_trains_on_bitwise(saved, tmp_path):
    on, _, root = saved
    resume_dir = str(tmp_path / "from")
    shutil.copytree(os.path.join(root, "on"), resume_dir)
    shutil.rmtree(os.path.join(resume_dir, f"iter_{2 * SAVE_INTERVAL:07d}"))
    with open(os.path.join(resume_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(SAVE_INTERVAL))
    case = dataclasses.replace(_case(), name="megatron-fsdp-dp2-resume", save_interval=None)
    resumed = runner.run(case, offload=True, extra_flags=("--load", resume_dir))
    for rank in range(2):
        assert len(resumed.ranks[rank]["iterations"]) == case.train_iters - SAVE_INTERVAL
        assert _values(resumed, rank) == _values(on, rank)[SAVE_INTERVAL:], rank
        assert all(e["offloader"]["is_offloaded"] for e in resumed.ranks[rank]["iterations"])
        # The offloader attached before setup_model_and_optimizer loaded the checkpoint: the
        # load wrote the host copy, with no byte of states and masters on the device in the
        # DTensors torch DCP read into, nor after it.
        (load,) = resumed.ranks[rank]["loads"]
        assert load["read_device_bytes"] == [0] and load["after"] == 0, load


def test_the_stock_script_streams_the_states_with_the_chunked_update(saved, tmp_path):
    """``--offload-chunked-update-bytes`` under Megatron-FSDP through the stock script: the
    states' shards streamed in several update calls per step once they exist, every
    iteration bitwise with the plain run, nothing resident between steps."""
    _, off, _ = saved
    case = dataclasses.replace(
        _case(),
        name="megatron-fsdp-dp2-chunked",
        offload_flags=("--offload-chunked-update-bytes", str(256 * 1024)),
        save_interval=None,
    )
    on = runner.run(case, offload=True, save_dir=str(tmp_path / "chunked"))
    for rank in range(2):
        assert _values(on, rank) == _values(off, rank), f"rank {rank}"
        entries = on.ranks[rank]["iterations"]
        assert all(e["offloader"]["resident_bytes"] == 0 for e in entries)
        chunks = [e["offloader"]["update_chunks"] for e in entries]
        assert all(n >= 2 for n in chunks[1:]), chunks
    assert _params_norms(on) == _params_norms(off)
