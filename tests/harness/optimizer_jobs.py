"""Rank-side jobs and comparisons shared by the Transformer Engine / apex adapter tests.

Jobs run inside the rank pool (real megatron-core DDP + DistributedOptimizer on gloo CPU ranks).
They make megatron-core pick a FusedAdam double (``tests/harness/doubles``) for the duration of the job,
train with or without ``megatron_offload.attach`` and return everything a bitwise comparison
needs, including the raw bytes behind FP8 moments and the TE scale tensors.
"""

from __future__ import annotations

import contextlib

import torch

from tests.harness import compare

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.uint8,  # TE's spelling of FP8 (E4M3) optimizer states
}


def precision_aware(
    remainders: bool = True,
    exp_avg: str = "fp32",
    exp_avg_sq: str | None = None,
    master: str = "fp32",
) -> dict:
    """OptimizerConfig fields for --use-precision-aware-optimizer (what the CLI flags set)."""
    return dict(
        use_precision_aware_optimizer=True,
        store_param_remainders=remainders,
        exp_avg_dtype=DTYPES[exp_avg],
        exp_avg_sq_dtype=DTYPES[exp_avg_sq or exp_avg],
        main_params_dtype=DTYPES[master],
    )


@contextlib.contextmanager
def injected(optimizer: str):
    from tests.harness.doubles import megatron_injection

    if optimizer == "te" or optimizer.startswith("te@"):
        # "te@2.12": the double behaves as that TE line (tests/harness/doubles/te_fused_adam.py).
        from tests.harness.doubles import te_fused_adam

        line = optimizer.partition("@")[2] or te_fused_adam.line_of(te_fused_adam.TE_VERSION)
        version = {"2.12": "2.12.0", "2.17": te_fused_adam.TE_VERSION, "2.19": "2.19.0"}[line]
        with te_fused_adam.te_line(line), megatron_injection.te_fused_adam_injected(version):
            yield
    elif optimizer == "apex":
        with megatron_injection.apex_fused_adam_injected():
            yield
    else:
        raise ValueError(optimizer)


def chunked_budget(optimizer, fraction: float, slots: int = 2) -> int:
    """``chunked_update_bytes`` for ``fraction`` of the largest inner optimizer's state bytes,
    raised to what its largest parameter needs (its states in a slot, plus the optimizer's
    temporaries), sized as the chunked update sizes them."""
    import math

    from megatron_offload.adapters import inner_optimizers
    from tests.harness import models

    budget = 0
    for distrib in models.distributed_optimizers(optimizer):
        inner = distrib.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        planned = [
            inner_optimizers.planned_state_bytes(inner, p, moments=True, masters=True)[0]
            for p in params
        ]
        ratio = max(
            (inner_optimizers.transient_bytes(inner, p) / n for p, n in zip(params, planned) if n),
            default=0.0,
        )
        need = -(-math.ceil(max(planned) * (slots + ratio)) // 16) * 16
        budget = max(budget, need, int(fraction * sum(planned)))
    return budget


# ------------------------------------------------------------------ inspection (rank side)
def inner_optimizers(optimizer):
    from tests.harness import models

    return [d.optimizer for d in models.distributed_optimizers(optimizer)]


def state_buffers(value):
    """The tensors holding a state's bytes: the tensor itself, or an FP8 tensor's buffers."""
    from tests.harness.doubles.te_fused_adam import Float8Tensor

    if isinstance(value, Float8Tensor):
        return {"_data": value._data, "_transpose": value._transpose}
    return {"": value}


def state_census(optimizer) -> dict:
    """Storage bytes of every per-element state buffer, found without the adapter.

    Walks the inner optimizers' states directly (FP8 moments through their ``_data`` and
    ``_transpose``) so that a buffer the adapter failed to yield still shows up here.
    Reading storage sizes never touches the (possibly released) memory.
    """
    buffers, storage_bytes, tensor_bytes = 0, [], 0
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                # dict's own lookup: the guarded mapping would bring offloaded states back.
                for key, value in dict.get(inner.state, param, {}).items():
                    if key == "step" or not isinstance(value, torch.Tensor):
                        continue
                    for buf in state_buffers(value).values():
                        if buf is None or buf.numel() != param.numel():
                            continue
                        buffers += 1
                        storage_bytes.append(buf.untyped_storage().nbytes())
                        tensor_bytes += buf.numel() * buf.element_size()
    return {
        "buffers": buffers,
        "max_storage": max(storage_bytes, default=0),
        "tensor_bytes": tensor_bytes,
    }


# The figures of ``stats()`` the jobs record after each step.
STATS_KEYS = (
    "tracked_bytes",
    "offloaded_bytes",
    "resident_bytes",
    "host_bytes",
    "kept_resident_bytes",
    "d2h_copies",
    "h2d_copies",
    "cycles",
)


def piece_places(offloader) -> dict:
    """``{kind: set of places}`` of every piece of every engine (``"resident"``, ``"released"``...)."""
    places = {}
    for engine in offloader.engines:
        for piece in engine.pieces:
            places.setdefault(piece.kind, set()).add(piece.place.value)
    return places


def collected(offloader) -> list[torch.Tensor]:
    from megatron_offload.adapters import megatron_wrappers as adapter

    return [t for m in offloader.members for _, t in adapter.collect(m.optimizer)]


def figures(offloader, optimizer) -> dict:
    stats = offloader.stats()
    tensors = collected(offloader)
    census = state_census(optimizer)
    return {
        **{k: stats[k] for k in STATS_KEYS},
        "groups": sum(len(e.pieces) for e in offloader.engines),
        "tensors": len(tensors),
        "max_storage": max((t.untyped_storage().nbytes() for t in tensors), default=0),
        "subclasses": sum(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors),
        "census_buffers": census["buffers"],
        "census_max_storage": census["max_storage"],
    }


def snapshot(model_chunks, optimizer) -> dict:
    """Model params plus every byte of optimizer state: FP8 internals, TE scales, group steps."""
    from tests.harness.doubles.te_fused_adam import Float8Tensor

    params = {
        f"{i}.{name}": p.detach().clone()
        for i, chunk in enumerate(model_chunks)
        for name, p in chunk.named_parameters()
    }
    state = {}
    for o, inner in enumerate(inner_optimizers(optimizer)):
        scales = getattr(inner, "_scales", {})
        for g, group in enumerate(inner.param_groups):
            state[(o, g, "group_step")] = group.get("step")
            for i, param in enumerate(group["params"]):
                state[(o, g, i, "param")] = param.detach().clone()
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, Float8Tensor):
                        state[(o, g, i, key, "_data")] = value._data.clone()
                        state[(o, g, i, key, "_transpose")] = value._transpose.clone()
                        state[(o, g, i, key, "_scale_inv")] = value._scale_inv.clone()
                        state[(o, g, i, key, "scale")] = value._quantizer.scale.clone()
                        state[(o, g, i, key, "amax")] = value._quantizer.amax.clone()
                        state[(o, g, i, key, "dtype")] = str(value.dtype)
                    elif isinstance(value, torch.Tensor):
                        state[(o, g, i, key)] = value.detach().clone()
                    else:
                        state[(o, g, i, key)] = value
                for key, scale in scales.get(param, {}).items():
                    state[(o, g, i, "_scales", key)] = scale.clone()
    return {"params": params, "optimizer": state}


def layout(optimizer) -> dict:
    """{state key: (python type, dtype, bytes per element incl. FP8 buffers)} of the first param."""
    from tests.harness.doubles.te_fused_adam import Float8Tensor

    inner = inner_optimizers(optimizer)[0]
    param = inner.param_groups[0]["params"][0]
    out = {"param_dtype": str(param.dtype)}
    for key, value in inner.state.get(param, {}).items():
        if not isinstance(value, torch.Tensor):
            out[key] = (type(value).__name__, None, None)
            continue
        if isinstance(value, Float8Tensor):
            per = value._data.element_size() + value._transpose.element_size()
            out[key] = ("Float8Tensor", str(value.dtype), per, str(value._data.dtype))
        else:
            out[key] = (type(value).__name__, str(value.dtype), value.element_size())
    out["scales"] = sorted(getattr(inner, "_scales", {}).get(param, {}))
    return out


# ---------------------------------------------------------------------------- the job
def train_job(
    optimizer_kind,
    model,
    dtype,
    steps,
    offload,
    *,
    overrides=None,
    options=None,
    checked=False,
    drop_grads=None,
    **build_kw,
):
    """Train ``steps`` iterations with the FusedAdam double ``optimizer_kind`` ('te'/'apex').

    drop_grads: {index into the inner optimizer's parameters (all groups, in order): number of
        first steps without a gradient}, applied by an inner-optimizer step pre-hook (apex
        FusedAdam then has no state for that parameter yet).
    """
    import megatron_offload
    from tests.harness import models

    with injected(optimizer_kind):
        chunks, optimizer, config = models.build(
            model, dtype, optimizer_overrides=dict(overrides or {}), **build_kw
        )
        classes = models.optimizer_classes(optimizer)
        inner = inner_optimizers(optimizer)[0]
        if drop_grads:
            counter = {"steps": 0}

            def drop(opt, args, kwargs):
                counter["steps"] += 1
                flat = [p for g in opt.param_groups for p in g["params"]]
                for index, until in drop_grads.items():
                    if counter["steps"] <= until:
                        flat[index].grad = None

            inner.register_step_pre_hook(drop)

        options = dict(options or {})
        devices = []
        if checked:
            from megatron_offload_testing import CheckedDevice

            def factory(torch_device):
                devices.append(CheckedDevice())
                return devices[-1]

            options["device_factory"] = factory
        offloader = megatron_offload.attach(optimizer, **options) if offload else None
        results, figs, layouts = [], [], []
        for step in range(steps):
            results.append(models.train_step(chunks, optimizer, config, step))
            if offloader:
                figs.append(figures(offloader, optimizer))
            if drop_grads:
                flat = [p for g in inner.param_groups for p in g["params"]]
                layouts.append(sorted(i for i, p in enumerate(flat) if p in inner.state))
        resident = None
        if offloader:
            offloader.reload()
            offloader.wait()
            resident = state_census(optimizer)
        models.flush_param_gather(chunks)
        snap = snapshot(chunks, optimizer)
        for device in devices:
            device.check()
        return {
            "classes": classes,
            "results": results,
            "figures": figs,
            "snapshot": snap,
            "layout": layout(optimizer),
            "resident_census": resident,
            "state_params": layouts,
            "checked_calls": [dict(d.calls) for d in devices],
        }


# ---------------------------------------------------------------------- comparisons (parent)
def is_amax(key) -> bool:
    """An FP8 quantizer's amax. FusedAdam never reads it (it sets each moment's scale from the
    moment's absmax), and after a ``load_state_dict``/``set_scaled_state`` that creates a state,
    TE has quantized an uninitialized ``torch.empty_like`` uint8 buffer into it: it then holds
    whatever that memory held, from run to run, with or without offloading."""
    return isinstance(key, tuple) and key[-1] == "amax"


def assert_bitwise_equal(reference, offloaded, *, ignore=lambda key: False):
    """The same optimizer classes, results and bytes everywhere (keys for which ``ignore(key)``
    is true excepted; see ``is_amax``)."""
    for ref, off in zip(reference, offloaded):
        assert ref["classes"] == off["classes"]
    compare.assert_bitwise_equal(reference, offloaded, ignore=ignore)


def assert_offloaded_between_steps(offloaded, groups: int):
    """Every per-element state buffer holds no device memory after every step."""
    for rank in offloaded:
        assert rank["figures"], "no offloading figures recorded"
        for fig in rank["figures"]:
            assert fig["tracked_bytes"] > 0
            assert fig["offloaded_bytes"] == fig["tracked_bytes"]
            assert fig["resident_bytes"] == 0 and fig["kept_resident_bytes"] == 0
            assert fig["subclasses"] == 0  # the FP8 wrappers are never handed to the engine
            assert fig["max_storage"] == 0  # what the adapter collected
            assert fig["census_buffers"] > 0 and fig["census_max_storage"] == 0  # all of it
            assert fig["host_bytes"] == fig["tracked_bytes"]
        last = rank["figures"][-1]
        assert last["groups"] == groups
        assert last["d2h_copies"] == groups and last["h2d_copies"] == groups
        # Everything the adapter moves is exactly the per-element state, counted independently.
        assert rank["resident_census"]["tensor_bytes"] == last["tracked_bytes"]
