"""The custom-loop checkpoint recipe (examples/checkpoint_offload.py): saved while offloaded,
resumed by a freshly built model and optimizer, bitwise as the run that went on."""

import argparse
import sys

import torch

from tests.harness.examples import EXAMPLES, load_example


def _example():
    sys.path.insert(0, EXAMPLES)
    return load_example("checkpoint_offload.py")


def _shared(path):
    shared = [path]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def recipe_job(directory, mode):
    example = _example()
    args = argparse.Namespace(bf16=True, steps=5, save_at=2)
    run = example.run_save if mode == "save" else example.run_resume
    return run(args, _shared(directory))


def test_the_checkpoint_recipe_saves_offloaded_and_resumes_bitwise(rank_pool, tmp_path):
    directory = str(tmp_path / "checkpoint")
    saved = rank_pool.run(recipe_job, directory, "save")
    resumed = rank_pool.run(recipe_job, directory, "resume")
    for before, after in zip(saved, resumed):
        assert before["on_device_at_save"] == 0  # the save was served from the host copy
        assert len(before["losses"]) == 5 and after["losses"] == before["losses"][2:]
        assert after["offloaded_after"]
        assert after["summary"].startswith("offloaded ") and "3 cycles" in after["summary"]
