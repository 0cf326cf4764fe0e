"""How the inner optimizers of a DistributedOptimizer keep their per-parameter tensors.

megatron-core's ``get_megatron_optimizer`` wraps one of three Adams (in order of preference):

==========================  =================================================================
Transformer Engine           ``state[p]``: ``exp_avg``, ``exp_avg_sq`` and, on the
``FusedAdam`` (TE 2.x;       precision-aware path (``--use-precision-aware-optimizer``, master
read from TE 2.8 to          weights in the optimizer), ``master_param``; each shaped like ``p``
2.17.1 and release_v2.19)    (the bf16 parameter shard), created for every parameter of a group
                             at the first ``step()``. Dtypes: fp32; fp16 (value/scale, the fp32
                             ``[1]`` scale in ``optimizer._scales[p][name]``); bf16 (plain);
                             FP8 E4M3 (``exp_avg_dtype=torch.uint8``): a ``Float8Tensor``, a
                             wrapper subclass whose ``.dtype`` reads float32 and whose bytes are
                             in ``_data`` (uint8, ``p``'s shape) and ``_transpose`` (uint8, the
                             same number of elements; allocated because TE creates the moment's
                             quantizer with columnwise usage), with ``[1]`` tensors beside them
                             (``_scale_inv``, the quantizer's ``scale`` and ``amax``).
                             ``master_param`` is fp32 (fp16 with ``main_params_dtype=fp16``), or
                             int16 low bits with ``store_param_remainders`` and bf16 params (the
                             high bits are the bf16 parameter itself). No per-parameter step:
                             ``group["step"]`` is an int.
apex ``FusedAdam``           ``state[p]``: fp32 ``exp_avg``, ``exp_avg_sq`` created at the first
                             step in which ``p`` has a gradient (not at all for parameters that
                             never get one); ``group["step"]`` is an int; its own master weights
                             (``param_groups_master``) are never enabled by megatron-core.
``torch.optim.AdamW``        ``state[p]``: ``step`` (a scalar tensor), ``exp_avg``,
(the fallback)               ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), fp32.
==========================  =================================================================

Other optimizers megatron-core builds keep other states, found the same way (from the state
itself, never from a list of names): torch's SGD and Muon (``emerging_optimizers``'
``OrthogonalizedOptimizer``, megatron-core's ``TensorParallelMuon``) a ``momentum_buffer``
like the parameter; Lion an ``exp_avg`` like the parameter; SOAP fp32 ``exp_avg`` and
``exp_avg_sq`` like the parameter, the Kronecker factors ``L`` ([m, m]) and ``R`` ([n, n]) of
an [m, n] parameter and their eigenbases ``Q_L``, ``Q_R`` (same shapes), and a Python int
``step``. SOAP *replaces* ``exp_avg``, ``exp_avg_sq``, ``Q_L`` and ``Q_R`` by new tensors at
every step (the others update in place); ``megatron_wrappers.StateWatch`` notices that.

What is moved: every tensor holding per-parameter data, that is each plain state tensor with
more than one element or as many elements as the parameter (moments, momentum buffers,
preconditioners, whatever their shape), and, for a quantized state (a tensor subclass such as
``Float8Tensor``), the plain data buffers inside it (``_data``, ``_transpose``, and the
``_rowwise_data``/``_columnwise_data`` of TE's other quantized layouts) that have as many
elements as the parameter. The wrapper object itself owns no memory and stays in the state, so
the optimizer and its state-dict keys never notice. ``step`` counters, scalars and ``[1]``
scales never move: they are tiny, and optimizers read and write them around every update.

A ``DTensor`` (Megatron-FSDP's states) holds this rank's shard in a plain local tensor,
which is what moves (``_local_tensor``; an empty shard holds nothing and stays). A tensor
subclass whose layout is not known here is handed over as it is; the engine keeps such tensors
resident and reports them (``kept_resident_bytes``) rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..engine.pieces import aligned_size, is_plain
from .holders import Holder

# Per-parameter state entries that are not moved, whatever their size.
NEVER_MOVED = frozenset({"step"})
# State entries that hold master weights rather than moments.
MASTER_KEYS = frozenset({"master_param"})
# Plain data buffers inside TE's quantized tensors (Float8Tensor: _data, _transpose; MXFP8 and
# blockwise-FP8 tensors: _rowwise_data, _columnwise_data). Their scale tensors are not listed:
# they are either [1] or a fraction of the parameter's size.
# ``_transpose`` is copied out and back like the data, although FusedAdam never reads it (its
# step only dequantizes ``_data`` and rewrites the transpose at every quantize): TE's own
# Float8Tensor methods do read it outside the step (``clone()`` copies it, ``view()`` and
# ``make_like`` pass it on, a Float8Tensor-to-Float8Tensor ``copy_`` copies the source's when
# it is marked valid, ``copy_from_storage`` too), and ``clone`` hands it over as valid even
# when the source was marked invalid. A transpose regrown without its bytes would therefore
# spread stale data through any of them (a ``deepcopy`` of the state included), and nothing
# lets the offloader prove none runs while the states are released. The cost is one extra
# byte per FP8 moment element per copy, where TE allocates the transpose at all.
QUANTIZED_DATA_ATTRS = ("_data", "_transpose", "_rowwise_data", "_columnwise_data")

TE_FUSED_ADAM = "Transformer Engine FusedAdam"
APEX_FUSED_ADAM = "apex FusedAdam"
TORCH_ADAM = "torch Adam/AdamW"
OTHER = "other"


def quantized_buffers(value: torch.Tensor, numel: int) -> list[str]:
    """Names of the plain per-element buffers inside a quantized tensor subclass (empty if none).

    ``numel`` is the parameter's element count: only buffers of that size are per-element data.
    """
    if is_plain(value):
        return []
    names = []
    for name in QUANTIZED_DATA_ATTRS:
        inner = getattr(value, name, None)
        if isinstance(inner, torch.Tensor) and is_plain(inner) and inner.numel() == numel:
            names.append(name)
    return names


def dtensor_local(value: torch.Tensor) -> torch.Tensor | None:
    """The plain local tensor of a ``DTensor`` (Megatron-FSDP's parameters and states hold
    this rank's shard in one), else None."""
    if type(value).__name__ != "DTensor":
        return None
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) and is_plain(local) else None


def state_tensors(param: torch.Tensor, entries) -> Iterator[tuple[str, torch.Tensor]]:
    """``(state key, tensor)`` for every per-parameter tensor of one parameter's state.

    Keys are visited in sorted order and the buffers of a quantized state in a fixed order, so
    an unchanged state yields the same tensors in the same order every time.
    """
    for key, _, tensor in state_places(param, entries):
        yield key, tensor


def state_places(param: torch.Tensor, entries) -> Iterator[tuple[str, Holder, torch.Tensor]]:
    """``(state key, holder, tensor)`` for the tensors of ``state_tensors``, in its order:
    ``holder`` is where the optimizer finds the tensor, the entry of the parameter's state
    dict or, for a buffer inside a quantized state, that state's attribute."""
    numel = param.numel()
    for key in sorted(entries):
        value = entries[key]
        if key in NEVER_MOVED or not isinstance(value, torch.Tensor):
            continue
        local = dtensor_local(value)
        if local is not None:
            # A DTensor (Megatron-FSDP): this rank's shard is its plain local tensor.
            yield key, Holder(value, "_local_tensor"), local
            continue
        buffers = quantized_buffers(value, numel)
        if buffers:
            for name in buffers:
                yield key, Holder(value, name), getattr(value, name)
        elif value.numel() == numel or (value.numel() > 1 and is_plain(value)):
            # A plain tensor (a moment, a momentum buffer, a preconditioner), or a subclass of
            # unknown layout as large as the parameter (which the engine keeps resident).
            yield key, Holder(entries, key), value
        # Anything else (scalars, [1] scales) stays where it is.


def is_master_key(key: str) -> bool:
    return key in MASTER_KEYS


def kind_of(optimizer) -> str:
    """Which of megatron-core's Adams ``optimizer`` is (by what it offers, not by import)."""
    if all(
        hasattr(optimizer, name)
        for name in ("get_unscaled_state", "set_scaled_state", "name_to_dtype_map")
    ):
        return TE_FUSED_ADAM
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return TORCH_ADAM
    if type(optimizer).__name__ == "FusedAdam":
        return APEX_FUSED_ADAM
    return OTHER


# ---------------------------------------------------------------- sizes before the states exist
def _aligned(numel: int, itemsize: int) -> int:
    # Every tensor starts aligned in a slot and in a host group (engine/groups.py).
    return aligned_size(numel * itemsize)


def _te_state_dtypes(optimizer, param) -> dict[str, torch.dtype]:
    """State name -> the dtype of the memory TE's FusedAdam will allocate for ``param``
    (read from the optimizer's own configuration, as its ``_initialize_state`` does)."""
    names = ["exp_avg", "exp_avg_sq"] + (
        ["master_param"] if getattr(optimizer, "master_weights", False) else []
    )
    dtypes = {}
    for name in names:
        dtype = optimizer.name_to_dtype_map[name]
        if (
            name == "master_param"
            and getattr(optimizer, "store_param_remainders", False)
            and param.dtype == torch.bfloat16
        ):
            dtype = torch.int16  # the low 16 bits; the high bits are the bf16 parameter
        dtypes[name] = dtype
    return dtypes


def planned_state_bytes(optimizer, param, *, moments: bool, masters: bool) -> tuple[int, bool]:
    """``(bytes, exact)``: what ``param``'s states will take in a slot, before they exist.

    ``moments``/``masters``: whether moment states / master weights inside the state are
    streamed (kinds not offloaded stay on the device and take no slot).

    torch's Adam/AdamW and apex's FusedAdam: moments shaped and typed like the parameter (two,
    three with amsgrad): exact. Transformer Engine's FusedAdam: from ``name_to_dtype_map``,
    ``master_weights`` and ``store_param_remainders``; an FP8 (uint8) moment counts its
    ``_data`` and its ``_transpose`` (one byte each per element; TE allocates the transpose
    where FP8 GEMMs need it, so on hardware without it this is an upper bound, never too
    small). Any other optimizer: one byte per element for each of two moments, a lower bound.
    """
    numel = param.numel()
    kind = kind_of(optimizer)
    if kind in (TORCH_ADAM, APEX_FUSED_ADAM):
        if not moments:
            return 0, True
        count = 3 if any(g.get("amsgrad") for g in optimizer.param_groups) else 2
        return count * _aligned(numel, param.element_size()), True
    if kind == TE_FUSED_ADAM:
        total = 0
        for name, dtype in _te_state_dtypes(optimizer, param).items():
            if not (masters if is_master_key(name) else moments):
                continue
            if dtype == torch.uint8:
                total += 2 * _aligned(numel, 1)  # _data and _transpose
            else:
                total += _aligned(numel, torch.empty((), dtype=dtype, device="meta").element_size())
        return total, True
    return (2 * _aligned(numel, 1) if moments else 0), False


def te_fuses_bf16_moments(optimizer) -> bool:
    """True where TE's kernel updates bf16 moments in place (TE >= 2.13: ``fuse_unscale``,
    set when both moments are bf16), so no fp32 temporaries are made for them."""
    return bool(getattr(optimizer, "fuse_unscale", False))


def transient_bytes(optimizer, param) -> int:
    """Device bytes TE's ``FusedAdam.step`` allocates for ``param`` for the length of one call.

    Each state that is not fp32 (FP8 and fp16 moments, fp16 masters, bf16 moments where they
    are not fused) is unscaled into a new fp32 tensor (``get_unscaled_state``) that the
    kernel updates and ``_apply_scale`` writes back: 4 bytes per element each, alive together
    for every parameter of the call. int16 remainders and fp32 states are used in place.
    Other optimizers: 0 (their updates work on the states themselves).
    """
    if kind_of(optimizer) != TE_FUSED_ADAM:
        return 0
    fused = te_fuses_bf16_moments(optimizer)
    total = 0
    for name, dtype in _te_state_dtypes(optimizer, param).items():
        if dtype in (torch.float32, torch.int16):
            continue
        if dtype == torch.bfloat16 and fused and not is_master_key(name):
            continue
        total += _aligned(param.numel(), 4)
    return total


@dataclass(frozen=True)
class StateAccess:
    """Methods of an inner optimizer that touch state tensor data outside ``step()``.

    Calling any of them while the states are released reads or writes freed memory (on a CPU
    this crashes the process; on a GPU it is an illegal memory access or silent corruption).

    ``reads``: need the states on the device, do not change them (the host copy stays valid).
    ``writes``: change states in place (the host copy is stale afterwards).
    ``replaces``: put new tensor objects into the state (picked up at the next offload).
    """

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    replaces: tuple[str, ...]


_TORCH_LIKE_ACCESS = StateAccess(
    # torch's state_dict() returns the live state tensors themselves; callers read them.
    reads=("state_dict",),
    writes=(),
    replaces=("load_state_dict",),
)
_TE_ACCESS = StateAccess(
    # TE's state_dict() unscales every state (dequantizes FP8, reads fp16/bf16 data) and returns
    # the live fp32/int16 tensors; get_unscaled_state reads, or returns the live tensor.
    reads=("state_dict", "get_unscaled_state"),
    # set_scaled_state copies into the existing tensor (and rescales it) when the state exists.
    writes=("set_scaled_state",),
    # load_state_dict rebuilds every state (and _scales) as new tensors; initialize_state too.
    replaces=("load_state_dict", "initialize_state"),
)


def state_access(optimizer) -> StateAccess:
    """The state-touching methods of ``optimizer`` (see ``StateAccess``)."""
    return _TE_ACCESS if kind_of(optimizer) == TE_FUSED_ADAM else _TORCH_LIKE_ACCESS


def written_tensors(optimizer, param: torch.Tensor, entries):
    """Every tensor with memory that an update of ``param`` may write: the parameter, the
    tensors of its state (plain ones, and the buffers inside a quantized state such as
    Transformer Engine's ``Float8Tensor``: data, transpose, scale, amax), and the per-state
    scales Transformer Engine keeps outside the state (``optimizer._scales[param]``). A DTensor
    parameter (Megatron-FSDP) is written through its local tensor, this rank's shard."""
    local = dtensor_local(param)
    yield param if local is None else local
    for value in (entries or {}).values():
        yield from _tensors_in(value)
    scales = getattr(optimizer, "_scales", None)
    if isinstance(scales, dict):
        for value in (scales.get(param) or {}).values():
            yield from _tensors_in(value)


def _tensors_in(value, depth: int = 0):
    if not isinstance(value, torch.Tensor):
        return
    if is_plain(value):
        yield value
        return
    # A tensor subclass keeps its bytes in plain tensors among its attributes, or in those
    # of an object it holds (a quantizer's scale and amax).
    for attribute in vars(value).values():
        if isinstance(attribute, torch.Tensor):
            yield from _tensors_in(attribute, depth + 1)
        elif depth == 0 and hasattr(attribute, "__dict__") and not isinstance(attribute, type):
            for inner in vars(attribute).values():
                if isinstance(inner, torch.Tensor):
                    yield from _tensors_in(inner, depth + 1)
