"""``--offload-optimizer-states`` with asynchronous checkpoint saves, and resuming from them.

examples/pretrain_gpt.py on 2 gloo ranks (bf16, DistributedOptimizer) with megatron's
asynchronous save (``--async-save --use-persistent-ckpt-worker --async-strategy mcore``,
``torch_dist``: the persistent writer process megatron-core 0.19 requires), saving at
iterations 3 and 5, against the plain script (no megatron_offload hook) saving synchronously:

* the run with offloading trains bitwise as the plain script, and each save sees the same
  optimizer state;
* no state comes back to the device for a save: the storages of the optimizer's own state
  tensors hold 0 bytes before and right after each save (all of them without offloading);
* the checkpoints hold bit for bit the tensors the plain script writes;
* a run resumed (with offloading) from the iteration-3 checkpoint trains iterations 4 and 5
  bit for bit as the run that never stopped.
"""

from __future__ import annotations

import os
import shutil

import torch

from tests.functional import runner
from tests.support.checkpoints import torch_dist_tensors

ASYNC_FLAGS = ("--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore")
CASE = runner.Case(
    "dp2-async",
    2,
    ("--bf16",) + ASYNC_FLAGS,
    save_interval=3,
    description="data parallel 2, bf16, asynchronous saves at iterations 3 and 5",
)
# The reference saves synchronously: megatron-core's asynchronous save hands a CPU state tensor
# that is a storage of its own (torch AdamW's moments on a CPU run) to the writer without a
# copy, so a writer slower than the next step writes that step's values (seen under load).
# Served from the host copy, every tensor the writer gets is a copy.
REFERENCE = runner.Case(
    "dp2-sync",
    2,
    ("--bf16",),
    save_interval=3,
    description="data parallel 2, bf16, synchronous saves at iterations 3 and 5",
)


def _values(run, rank):
    return [(e["lm_loss"], e["grad_norm"], e["skipped"]) for e in run.ranks[rank]["iterations"]]


def _files(directory):
    return sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
    )


def test_async_saves_from_the_host_and_resume_bitwise(tmp_path):
    on_dir, off_dir, resume_dir = (str(tmp_path / name) for name in ("on", "off", "resume"))
    on = runner.run(CASE, offload=True, save_dir=on_dir)
    off = runner.run(REFERENCE, offload=False, save_dir=off_dir)
    for rank in range(CASE.world_size):
        assert _values(on, rank) == _values(off, rank)
        assert on.ranks[rank]["saves"] == off.ranks[rank]["saves"]
        saved_on = on.ranks[rank]["save_storage_bytes"]
        saved_off = off.ranks[rank]["save_storage_bytes"]
        assert [s["iteration"] for s in saved_on] == [3, 5]
        assert all(s["before"] == s["after"] == 0 for s in saved_on), saved_on
        assert all(s["before"] == s["after"] > 0 for s in saved_off), saved_off
    # The checkpoints: the same files, and every tensor in them bit for bit (the files' bytes
    # also hold the run's arguments, whose --save path differs).
    assert _files(on_dir) == _files(off_dir)
    for iteration in ("iter_0000003", "iter_0000005"):
        written_on = torch_dist_tensors(os.path.join(on_dir, iteration), str(tmp_path / "on.pt"))
        written_off = torch_dist_tensors(os.path.join(off_dir, iteration), str(tmp_path / "off.pt"))
        assert written_on.keys() == written_off.keys()
        assert any("exp_avg_sq" in key for key in written_on) and any(
            "fp32_param" in key or ".param" in key for key in written_on
        ), list(written_on)
        for key, value in written_off.items():
            assert torch.equal(value, written_on[key]), (iteration, key)

    # Resume from iteration 3 (the later checkpoint set aside).
    shutil.copytree(on_dir, resume_dir)
    shutil.rmtree(os.path.join(resume_dir, "iter_0000005"))
    with open(os.path.join(resume_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    resumed = runner.run(
        CASE, offload=True, save_dir=str(tmp_path / "resumed"), extra_flags=("--load", resume_dir)
    )
    for rank in range(CASE.world_size):
        assert _values(resumed, rank) == _values(on, rank)[3:], rank
