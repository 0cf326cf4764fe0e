"""Run a pretrain script on this rank and record its exact per-iteration figures.

    MO_RECORD_DIR=out torchrun ... tests/functional/record_pretrain.py launch SCRIPT [ARGS...]
    MO_RECORD_DIR=out torchrun ... tests/functional/record_pretrain.py direct SCRIPT [ARGS...]

``launch`` runs the script through ``megatron_offload.launch`` (the runtime route); ``direct``
runs it as plain ``python SCRIPT`` (for a patched Megatron source tree on PYTHONPATH).

Each rank writes ``rank<N>.json`` to ``MO_RECORD_DIR``: for every training iteration the lm
loss and grad norm exactly (``float.hex``), whether it was skipped, and the offloader's stats
after the step next to the byte count the optimizer's own tensors add up to; for every
checkpoint save a digest of all optimizer state as the save saw it. Values come from hooks on
megatron.training (``train_step``, ``save_checkpoint``), never from the log text, whose
"lm loss" averages over the log interval.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import runpy
import sys

from megatron_offload import find_offloader
from megatron_offload_testing.records import chain_members, exact


def _state_tensors(optimizer, *, whole_buffers: bool = False):
    """(name, tensor) of every per-parameter tensor an offloader may move, in a stable order:
    the inner optimizer's moments (a DTensor's local shard under Megatron-FSDP) and the fp32
    master shards (metadata only: no data read). Under Megatron-FSDP the masters are views into
    one buffer per parameter group: ``whole_buffers`` gives the buffers (what moves, padding
    included), else each parameter's view (what the update writes)."""
    import torch

    for index, dopt in enumerate(chain_members(optimizer)):
        for g, group in enumerate(dopt.optimizer.param_groups):
            for p, param in enumerate(group["params"]):
                # dict's own lookup: the offloader's guarded mapping would bring the states back.
                for key, value in sorted(dict.get(dopt.optimizer.state, param, {}).items()):
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and key != "step":
                        yield f"{index}.{g}.{p}.{key}", getattr(value, "_local_tensor", value)
        if getattr(getattr(dopt, "ddp_config", None), "use_megatron_fsdp", False):
            if whole_buffers:
                groups = [
                    group
                    for chunk in dopt.model_chunks
                    for group in chunk.module.param_and_grad_buffer.parameter_groups
                ]
                for g, group in enumerate(groups):
                    if group.main_weight_buffer is not None:
                        yield f"{index}.{g}.main_weight_buffer", group.main_weight_buffer.data
            else:
                for g, group in enumerate(dopt.optimizer.param_groups):
                    for p, param in enumerate(group["params"]):
                        yield f"{index}.{g}.{p}.master", param._local_tensor
            continue
        masters = getattr(dopt, "shard_fp32_from_float16_groups", None) or []
        for g, group in enumerate(masters):
            for p, master in enumerate(group):
                if master is not None:
                    yield f"{index}.{g}.{p}.master", master


def _expected_offload_bytes(optimizer) -> int:
    tensors = _state_tensors(optimizer, whole_buffers=True)
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _host_storages(optimizer) -> set:
    """The data pointers of the offloader's host copy's storages (none without one)."""
    offloader = find_offloader(optimizer)
    return {
        piece.host.untyped_storage().data_ptr()
        for engine in (offloader.engines if offloader is not None else ())
        for piece in engine.pieces
        if piece.host is not None
    }


def _state_storage_bytes(optimizer) -> int:
    """Bytes the storages of the optimizer's state tensors hold now (0 for a released one),
    each storage once, but for the offloader's host copy (in a host view a Megatron-FSDP
    DTensor's local tensor is pointed at it); reads no data."""
    host = _host_storages(optimizer)
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for _, t in _state_tensors(optimizer, whole_buffers=True)
        if t.untyped_storage().data_ptr() not in host
    }
    return sum(storages.values())


def _dtensor_device_bytes(state_dict, optimizer) -> int:
    """Bytes the storages of the local tensors of every DTensor a torch DCP save writes (or a
    load reads into) hold outside the offloader's host copy (fsdp_dtensor: the masters and
    states, the SwiGLU halves megatron-core re-wraps included), each storage once; reads no
    data."""
    from torch.distributed.tensor import DTensor

    host = _host_storages(optimizer)
    storages = {}
    stack = [state_dict]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, DTensor):
            storage = value._local_tensor.untyped_storage()
            if storage.data_ptr() not in host:
                storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


@contextlib.contextmanager
def _measuring_dcp(name: str, optimizer, into: list):
    """For the block, torch DCP's ``name`` (``save``, ``load_state_dict``) first appends to
    ``into`` the device bytes of the DTensors in the state dict it is handed."""
    import torch.distributed.checkpoint as dcp

    original = getattr(dcp, name)

    @functools.wraps(original)
    def measured(state_dict, *args, **kwargs):
        into.append(_dtensor_device_bytes(state_dict, optimizer))
        return original(state_dict, *args, **kwargs)

    setattr(dcp, name, measured)
    try:
        yield
    finally:
        setattr(dcp, name, original)


def _state_digest(optimizer) -> str:
    import torch

    digest = hashlib.sha256()
    for name, tensor in _state_tensors(optimizer):
        digest.update(name.encode())
        # A copy: on CPU, .cpu() aliases the live tensor, and Tensor.numpy() marks a storage
        # as not resizable for good (the offloader could no longer release it).
        data = tensor.detach().reshape(-1).to("cpu", copy=True)
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Recorder:
    def __init__(self, out_dir: str) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.out_dir = out_dir
        self.data = {"iterations": [], "saves": []}

    @property
    def path(self) -> str:
        rank = self._dist.get_rank() if self._dist.is_initialized() else 0
        return os.path.join(self.out_dir, f"rank{rank}.json")

    def flush(self) -> None:
        with open(self.path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(self.path + ".tmp", self.path)

    def wrap_train_step(self, original):
        @functools.wraps(original)
        def train_step(*args, **kwargs):
            optimizer = kwargs["optimizer"] if "optimizer" in kwargs else args[3]
            # What the states and masters hold on the device as the iteration starts (after
            # whatever ran between steps: a save, a parameter norm).
            held_at_start = _state_storage_bytes(optimizer)
            result = original(*args, **kwargs)
            loss_dict, skipped_iter, grad_norm = result[0], result[1], result[5]
            offloader = find_offloader(optimizer)
            entry = {
                "lm_loss": exact(loss_dict.get("lm loss")) if loss_dict else None,
                "grad_norm": exact(grad_norm),
                "skipped": int(skipped_iter),
                "expected_offload_bytes": _expected_offload_bytes(optimizer),
                "held_at_start": held_at_start,
                "offloader": None,
                # Megatron's own offloader (Megatron-LM dev's chunked one), where the line has it.
                "megatron_own_offloader": any(
                    getattr(dopt, "_optimizer_state_offloader", None) is not None
                    for dopt in chain_members(optimizer)
                ),
            }
            if offloader is not None:
                stats = offloader.stats()
                entry["offloader"] = {
                    key: stats[key]
                    for key in (
                        "offloaded_bytes",
                        "host_bytes",
                        "resident_bytes",
                        "tracked_bytes",
                        "d2h_copies",
                        "h2d_copies",
                        "cycles",
                        "update_chunks",
                        "update_copies",
                    )
                }
                entry["offloader"]["is_offloaded"] = offloader.is_offloaded
            self.data["iterations"].append(entry)
            self.flush()
            return result

        return train_step

    def wrap_save_checkpoint(self, original):
        @functools.wraps(original)
        def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
            # The digest reads the states as the save does: from the host copy while offloaded.
            offloader = find_offloader(optimizer)
            stored = _state_storage_bytes(optimizer)
            with offloader.host_view() if offloader is not None else contextlib.nullcontext():
                digest = _state_digest(optimizer)
            self.data["saves"].append({"iteration": iteration, "state_sha256": digest})
            written = []
            try:
                with _measuring_dcp("save", optimizer, written):
                    return original(iteration, model, optimizer, *args, **kwargs)
            finally:
                # Device bytes of the optimizer's own state tensors (their storages) before
                # and right after the save: what a save brought back to the device.
                self.data.setdefault("save_storage_bytes", []).append(
                    {
                        "iteration": iteration,
                        "before": stored,
                        "after": _state_storage_bytes(optimizer),
                        # Each torch DCP save of it (fsdp_dtensor): what its DTensors held
                        # on the device as the write began.
                        "written_device_bytes": written,
                    }
                )
                self.flush()

        return save_checkpoint


def wrap_load_checkpoint(original, recorder):
    """megatron-core (0.16-0.19) cannot load a ``torch_dist`` checkpoint into torch AdamW (the
    optimizer of this CPU environment: no TE, no apex) before it has states (``assert
    len(steps) == 1``), and after the load every parameter shares one stale ``step`` tensor.
    Both are megatron-core's own, with or without offloading: here the states are created
    first (as its TE/apex path expects) and, in a run without the offloader (which repairs the
    steps itself), the steps are repaired by hand, so that a resumed run can be compared.
    (``fsdp_dtensor`` loads make their states themselves.)

    Each torch DCP load of it (``fsdp_dtensor``) records what the DTensors it reads into hold
    on the device as it begins (``read_device_bytes``), and the optimizer's state storages
    right after the load."""

    @functools.wraps(original)
    def load_checkpoint(ddp_model, optimizer, *args, **kwargs):
        from megatron.training.global_vars import get_args

        if get_args().ckpt_format != "fsdp_dtensor":
            for dopt in chain_members(optimizer) if optimizer is not None else ():
                if hasattr(dopt, "_init_optimizer_states_with_dummy_values") and not len(
                    dopt.optimizer.state
                ):
                    dopt._init_optimizer_states_with_dummy_values()
        read = []
        with _measuring_dcp("load_state_dict", optimizer, read):
            result = original(ddp_model, optimizer, *args, **kwargs)
        recorder.data.setdefault("loads", []).append(
            {
                "read_device_bytes": read,
                "after": _state_storage_bytes(optimizer) if optimizer is not None else None,
            }
        )
        recorder.flush()
        if optimizer is not None and find_offloader(optimizer) is None:
            from megatron_offload.access.methods import restore_step_tensors

            for dopt in chain_members(optimizer):
                groups = dopt.optimizer.param_groups
                restore_step_tensors(dopt.optimizer, {"optimizer": {"param_groups": groups}})
        return result

    return load_checkpoint


def main(argv: list[str]) -> None:
    route, script_argv = argv[0], argv[1:]
    out_dir = os.environ["MO_RECORD_DIR"]
    import torch

    if not torch.cuda.is_available():
        from megatron_offload_testing import cpu_training

        cpu_training.install()
        # LayerWiseDistributedOptimizer (emerging optimizers with --use-distributed-optimizer)
        # all-gathers uneven sizes, which gloo refuses.
        sys.path.insert(
            0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        )
        from tests.harness.gloo import allow_uneven_all_gather

        allow_uneven_all_gather()
    import megatron.training.training as training

    recorder = Recorder(out_dir)
    recorder.data["megatron_training_file"] = training.__file__
    training.train_step = recorder.wrap_train_step(training.train_step)
    training.save_checkpoint = recorder.wrap_save_checkpoint(training.save_checkpoint)
    training.load_checkpoint = wrap_load_checkpoint(training.load_checkpoint, recorder)
    if route == "launch":
        from megatron_offload import launch

        launch.main(script_argv)
    elif route == "direct":
        sys.argv = list(script_argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
        runpy.run_path(script_argv[0], run_name="__main__")
    else:
        raise SystemExit(f"unknown route {route!r}: use launch or direct")
    recorder.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
