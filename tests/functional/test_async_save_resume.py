"""``--offload-optimizer-states`` with asynchronous checkpoint saves at every iteration, and
resuming from them.

examples/pretrain_gpt.py on 2 gloo ranks (bf16, DistributedOptimizer) with megatron's
asynchronous save (``--async-save --use-persistent-ckpt-worker --async-strategy mcore``,
``torch_dist``: the persistent writer process megatron-core 0.19 requires) at every iteration,
in whole and chunked mode with ``--ckpt-assume-constant-structure`` (the writer then reuses the
save plan it cached at the first save: where others lose checkpoints, an offload that
reallocates the states makes every later checkpoint hold the first one's bytes), and in
chunked mode without it (whole mode without it, a plan made at every save, is the rank-pool
test ``tests/integration/access/test_checkpoint.py``'s ``bf16-async``, which costs no
launch). Against the plain script (no megatron_offload hook) saving synchronously at every
iteration:

* every run trains bitwise as the plain script, and each save sees the same optimizer state;
* no state comes back to the device for a save: the storages of the optimizer's own state
  tensors hold 0 bytes before and right after each save (all of them without offloading);
* every checkpoint of every run holds bit for bit the tensors the plain script writes at the
  same iteration;
* runs resumed (with offloading, the constant structure on) from two of those checkpoints, of
  two of the runs, train on bit for bit as the runs that never stopped, the states and masters
  offloaded from the load on (not resident through the first iteration).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from tests.functional import runner
from tests.harness.checkpoints import torch_dist_tensors

ITERATIONS = 3
ASYNC_FLAGS = ("--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore")
CONSTANT = ("--ckpt-assume-constant-structure",)
CHUNKED = ("--offload-chunked-update-bytes", str(256 << 10))
# The reference saves synchronously: megatron-core's asynchronous save hands a CPU state tensor
# that is a storage of its own (torch AdamW's moments on a CPU run) to the writer without a
# copy, so a writer slower than the next step writes that step's values (seen under load).
# Served from the host copy, every tensor the writer gets is a copy.
REFERENCE = runner.Case(
    "dp2-sync-every",
    2,
    ("--bf16",),
    train_iters=ITERATIONS,
    save_interval=1,
    description="data parallel 2, bf16, synchronous saves at every iteration",
)
VARIANTS = {
    "whole-constant": (CONSTANT, ()),
    "chunked": ((), CHUNKED),
    "chunked-constant": (CONSTANT, CHUNKED),
}
# (variant, the iteration resumed from)
RESUMES = (("whole-constant", 1), ("chunked-constant", 2))


def _case(variant: str) -> runner.Case:
    flags, offload_flags = VARIANTS[variant]
    return dataclasses.replace(
        REFERENCE,
        name=f"dp2-async-every-{variant}",
        flags=REFERENCE.flags + ASYNC_FLAGS + flags,
        offload_flags=offload_flags,
        description=f"data parallel 2, bf16, asynchronous saves at every iteration ({variant})",
    )


def _values(run, rank, start=0):
    entries = run.ranks[rank]["iterations"][start:]
    return [(e["lm_loss"], e["grad_norm"], e["skipped"]) for e in entries]


def _files(directory):
    return sorted(
        os.path.relpath(os.path.join(root, name), directory)
        for root, _, names in os.walk(directory)
        for name in names
    )


@pytest.fixture(scope="module")
def expected(saved):
    """The plain script's checkpoint tensors, by iteration, read once."""
    root, runs = saved
    _, directory = runs["reference"]
    return {
        iteration: torch_dist_tensors(
            os.path.join(directory, f"iter_{iteration:07d}"), str(root / "ref.pt")
        )
        for iteration in range(1, ITERATIONS + 1)
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The reference and every variant, saved at every iteration: ``{name: (run, dir)}``."""
    root = tmp_path_factory.mktemp("saves")
    runs = {"reference": (runner.run(REFERENCE, offload=False, save_dir=str(root / "ref")),)}
    runs["reference"] += (str(root / "ref"),)
    for variant in VARIANTS:
        directory = str(root / variant)
        runs[variant] = (runner.run(_case(variant), offload=True, save_dir=directory), directory)
    return root, runs


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_asynchronous_save_holds_what_the_plain_script_saves(saved, expected, variant):
    root, runs = saved
    reference, reference_dir = runs["reference"]
    run, directory = runs[variant]
    for rank in range(REFERENCE.world_size):
        assert _values(run, rank) == _values(reference, rank)
        assert run.ranks[rank]["saves"] == reference.ranks[rank]["saves"]
        on = run.ranks[rank]["save_storage_bytes"]
        off = reference.ranks[rank]["save_storage_bytes"]
        assert [s["iteration"] for s in on] == list(range(1, ITERATIONS + 1))
        assert all(s["before"] == s["after"] == 0 for s in on), on
        assert all(s["before"] == s["after"] > 0 for s in off), off
        assert all(e["offloader"]["is_offloaded"] for e in run.ranks[rank]["iterations"])
    if variant.startswith("chunked"):
        # From the second step on the moments exist and stream through the slots in chunks.
        assert all(e["offloader"]["update_chunks"] >= 2 for e in run.ranks[0]["iterations"][1:])
    # The checkpoints: the same files, and every tensor in each bit for bit (the files' bytes
    # also hold the run's arguments, whose --save path differs).
    assert _files(directory) == _files(reference_dir)
    for iteration in range(1, ITERATIONS + 1):
        name = f"iter_{iteration:07d}"
        written = torch_dist_tensors(os.path.join(directory, name), str(root / f"{variant}.pt"))
        assert written.keys() == expected[iteration].keys()
        assert any("exp_avg_sq" in key for key in written), list(written)
        for key, value in expected[iteration].items():
            assert torch.equal(value, written[key]), (variant, iteration, key)


@pytest.mark.parametrize("variant,iteration", RESUMES, ids=[f"{v}-{i}" for v, i in RESUMES])
def test_a_resume_from_a_saved_iteration_trains_on_bitwise(saved, variant, iteration, tmp_path):
    _, runs = saved
    run, directory = runs[variant]
    resume_dir = str(tmp_path / "from")
    shutil.copytree(directory, resume_dir)
    for later in range(iteration + 1, ITERATIONS + 1):
        shutil.rmtree(os.path.join(resume_dir, f"iter_{later:07d}"))
    with open(os.path.join(resume_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    # The resumed run only loads: it trains with the variant's offload options, saving nothing.
    resumed = runner.run(
        dataclasses.replace(
            REFERENCE,
            name=f"dp2-resume-{variant}",
            save_interval=None,
            offload_flags=VARIANTS[variant][1],
        ),
        offload=True,
        extra_flags=("--load", resume_dir),
    )
    for rank in range(REFERENCE.world_size):
        assert _values(resumed, rank) == _values(run, rank, iteration), rank
        # The load (before the first step) is offloaded right after it: the first iteration's
        # forward and backward run without the states and masters on the device.
        assert resumed.ranks[rank]["iterations"][0]["held_at_start"] == 0, rank
