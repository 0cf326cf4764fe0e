"""Checkpoints in your own training loop: save while the states are offloaded, resume in a
fresh process.

    torchrun --nproc-per-node 2 examples/checkpoint_offload.py save --dir /tmp/ckpt
    torchrun --nproc-per-node 2 examples/checkpoint_offload.py resume --dir /tmp/ckpt

``save`` trains ``--steps`` steps of the GPT of ``train_gpt_offload.py`` with the offloader
attached and saves a ``dist_checkpointing`` checkpoint after ``--save-at`` steps: the save
reads the optimizer states from their host copy, nothing comes back to the device. ``resume``
builds everything again in a new process, attaches, loads the checkpoint and trains the
remaining steps; it prints its losses beside those the ``save`` run recorded (identical).

The three things a custom loop must do, all in ``save_checkpoint`` / ``load_checkpoint``:

1. pass ``metadata={"distrib_optim_sharding_type": "dp_reshardable"}`` to the optimizer's
   ``sharded_state_dict``: megatron-core 0.19's default sharding type cannot be saved;
2. before building the load dict, give an optimizer that has no state yet its states
   (megatron-core's ``_init_optimizer_states_with_dummy_values``): with torch's AdamW
   (megatron-core's fallback without Transformer Engine or apex) building it fails
   otherwise (``assert len(steps) == 1``), offloading or not;
3. attach before loading: the load is then written into the host copy, and the offloader
   repairs the per-parameter ``step`` that megatron-core's load leaves shared and stale with
   torch's AdamW.

GPUs with NCCL where they exist, 2 CPU ranks with gloo otherwise (as ``train_gpt_offload.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the model of train_gpt_offload.py

import torch  # noqa: E402
from train_gpt_offload import build, train_step  # noqa: E402  (CPU redirects first)

# isort: split
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.utils import unwrap_model  # noqa: E402

import megatron_offload  # noqa: E402

SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def sharded_state_dict(model, optimizer, is_loading=False):
    model_state = unwrap_model(model).sharded_state_dict()  # the GPTModel's own keys
    return {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=SHARDING
        ),
    }


def save_checkpoint(model, optimizer, directory):
    """A save while offloaded: served from the host copy, nothing comes back to the device."""
    os.makedirs(directory, exist_ok=True)  # dist_checkpointing.save wants it to exist, empty
    torch.distributed.barrier()
    dist_checkpointing.save(sharded_state_dict(model, optimizer), directory)


@torch.no_grad()
def load_checkpoint(model, optimizer, directory):
    """Load into a freshly built model and optimizer (attached first: see the module's notes)."""
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        if member.optimizer is not None and not member.optimizer.state:
            member._init_optimizer_states_with_dummy_values()  # megatron-core needs states to load into
    state = dist_checkpointing.load(
        sharded_state_dict(model, optimizer, is_loading=True), directory
    )
    unwrap_model(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def train_steps(model, optimizer, steps):
    """The loop of train_gpt_offload.py; returns each step's loss."""
    return [train_step(model, optimizer, step) for step in steps]


def state_bytes_on_device(optimizer) -> int:
    """Bytes of the optimizer states and master weights that have device memory right now."""
    offloader = megatron_offload.find_offloader(optimizer)
    return offloader.stats()["resident_bytes"]


def run_save(args, directory):
    """Train, save after ``save_at`` steps while offloaded, train on; returns what it saw."""
    model, optimizer = build(args)
    offloader = megatron_offload.attach(optimizer)
    losses = train_steps(model, optimizer, range(args.save_at))
    save_checkpoint(model, optimizer, directory)
    on_device = state_bytes_on_device(optimizer)  # 0: the save read the host copy
    losses += train_steps(model, optimizer, range(args.save_at, args.steps))
    return {"losses": losses, "on_device_at_save": on_device, "summary": offloader.summary()}


def run_resume(args, directory):
    """A fresh model and optimizer: attach, load, train the remaining steps."""
    model, optimizer = build(args)
    offloader = megatron_offload.attach(optimizer)
    load_checkpoint(model, optimizer, directory)
    losses = train_steps(model, optimizer, range(args.save_at, args.steps))
    return {
        "losses": losses,
        "offloaded_after": offloader.is_offloaded,
        "summary": offloader.summary(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("save", "resume"))
    parser.add_argument(
        "--dir", required=True, help="the checkpoint directory (shared by the ranks)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--fp32", dest="bf16", action="store_false")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    parallel_state.initialize_model_parallel()
    rank = torch.distributed.get_rank()
    record = os.path.join(args.dir, "losses.json")
    if args.mode == "save":
        found = run_save(args, os.path.join(args.dir, "checkpoint"))
        if rank == 0:
            with open(record, "w") as out:
                json.dump(found["losses"], out)
            print(
                f"saved at step {args.save_at} with {found['on_device_at_save']} state bytes on the "
                f"device; losses {found['losses']}\n{found['summary']}",
                flush=True,
            )
    else:
        found = run_resume(args, os.path.join(args.dir, "checkpoint"))
        if rank == 0:
            saved = json.load(open(record))[args.save_at :] if os.path.exists(record) else None
            print(
                f"resumed: losses {found['losses']}\n  the save run's: {saved}\n"
                f"  identical: {'yes' if found['losses'] == saved else 'NO'}\n{found['summary']}",
                flush=True,
            )
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
