"""Reading a torch_dist checkpoint back in the test process."""

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
