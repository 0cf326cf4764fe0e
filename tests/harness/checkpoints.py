"""Reading a torch_dist checkpoint back in the test process, and writing a loaded one into a
harness model and its optimizer."""

from __future__ import annotations

import os
import tempfile


def torch_dist_tensors(checkpoint: str, scratch: str | None = None) -> dict:
    """Every tensor of a torch_dist checkpoint directory, keyed by its path in the saved
    state (``/optimizer/state/0/exp_avg``, ...); ``scratch`` is where the converted file
    goes (a temporary file, removed after, when None)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if scratch is None:
        handle, path = tempfile.mkstemp(suffix=".pt")
        os.close(handle)
        try:
            return torch_dist_tensors(checkpoint, path)
        finally:
            os.remove(path)
    dcp_to_torch_save(checkpoint, scratch)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}/{index}", item)

    walk("", torch.load(scratch, weights_only=False))
    return flat


def apply_loaded(chunks, optimizer, state: dict) -> None:
    """Write a loaded distributed checkpoint into the model and the optimizer: parameters by
    name without the DDP wrapper's ``module.`` prefixes (the harness models' sharded keys carry
    them), every parameter found, Transformer Engine's extra state left out."""
    import torch

    loaded = {
        k.replace("module.", ""): v
        for k, v in state["model"].items()
        if not k.endswith("_extra_state")
    }
    params = dict(chunks[0].named_parameters())
    assert len(params) == len(loaded)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(loaded[name.replace("module.", "")])
    optimizer.load_state_dict(state["optimizer"])
