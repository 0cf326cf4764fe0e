"""A CPU double of Transformer Engine's ``FusedAdam`` (TE 2.17) and of its FP8 ``Float8Tensor``.

Transformer Engine cannot be installed without CUDA, yet production megatron-core steps with its
``FusedAdam``, and with ``--use-precision-aware-optimizer`` the fp32 master weights live in that
optimizer's state. This module reproduces, in plain torch on any device, everything that decides
where TE keeps its tensors and how they are read and written, so that an offloader's TE path can
be exercised with megatron-core's own precision-aware code.

What it follows
---------------
Transformer Engine 2.17 (megatron-core 0.19 pins TE 2.17.1; ``TE_VERSION`` is what the injected
``transformer_engine.__version__`` reports). Read from NVIDIA/TransformerEngine:

* ``transformer_engine/pytorch/optimizers/fused_adam.py``: the revision read contains
  PR #2535 (``empty_like``/``zeros_like`` state allocation, TE 2.12) and predates PR #2698/#2795
  (DTensor-only changes: for plain tensors the behaviour below is unchanged through 2.17).
  The state layout itself dates from PR #1078 (fp16/fp8 states), PR #1408 (param remainders,
  TE 2.1) and bf16 moments (TE 2.3).
* ``transformer_engine/common/multi_tensor/adam.cu``: ``AdamFunctor``, ``AdamFunctorMaster``,
  ``AdamFunctorMasterParamRemainder`` and their host wrappers (bias corrections).
* ``transformer_engine/pytorch/tensor/float8_tensor.py``,
  ``transformer_engine/pytorch/tensor/storage/float8_tensor_storage.py`` and
  ``transformer_engine/pytorch/quantized_tensor.py`` (the TE >= 2.8 storage layout); reproduced in
  ``tests/doubles/te_float8.py``, whose names this module re-exports).

Release lines (``te_line``; each checked by ``tests/unit/adapters/test_te_lines.py``)
-------------------------------------------------------------------------------------
Read from the v2.8 ... v2.17.1 tags and release_v2.19/main: three lines differ in what an
offloader sees. "2.12" (2.8-2.12): every non-fp32 state is unscaled into an fp32 temporary.
"2.17" (2.13-2.18; ``fuse_unscale`` first appears in the v2.13 tag, not 2.14): both moments
bf16 are updated in place by the kernel, ``get_unscaled_state(..., skip_unscale=False)``
returns a bf16 state LIVE when asked, capturable accepts bf16 moments. "2.19" (PR #3318):
``group["step"]`` advances for empty groups too. The default is "2.17" (``TE_VERSION``).
``transient_bytes_last_call`` reports the fp32 temporaries of the last ``step()`` (TE makes
the same on the device, on top of the states: 4 bytes per element per unscaled state).

Behaviours reproduced (each is checked by ``tests/unit/adapters/test_te_double.py``)
----------------------------------------------------------------------------------
1. Constructor: keyword options ``master_weights``, ``master_weight_dtype`` (fp32/fp16),
   ``exp_avg_dtype``/``exp_avg_sq_dtype`` (fp32, fp16, bf16, uint8 = FP8 E4M3),
   ``use_decoupled_grad``, ``store_param_remainders`` (effective only with master weights in
   fp32), ``adam_w_mode``, ``bias_correction``, ``set_grad_none``; the same errors for amsgrad,
   unsupported dtypes and the capturable restrictions. ``name_to_dtype_map``,
   ``dtype_to_range_map`` (fp16: max/2, uint8: 448) and the ``_scales`` dict.
2. ``state[p]`` holds only ``exp_avg``, ``exp_avg_sq`` and (with master weights)
   ``master_param``, each shaped like ``p``; no per-parameter step: ``group["step"]`` is a Python
   int, +1 per ``step()`` for every non-empty group (even when no parameter has a gradient;
   from 2.19 for empty groups too).
3. State is created lazily in ``step()`` for every parameter of a group (gradient or not), by
   ``initialize_state(param, store_param_remainders)`` (both arguments required, as in TE), or by
   ``set_scaled_state`` on a missing name. Moments start at zero; ``master_param`` is a copy of
   the parameter, or an int16 remainder tensor of zeros in remainder mode (also for parameters
   that are not bf16 when remainders are requested explicitly). A state created without zeroing
   (``set_scaled_state`` on a missing name, hence every ``load_state_dict``) starts from
   ``torch.empty_like``: an FP8 one is first quantized from that uninitialized uint8 buffer, so
   its quantizer's ``amax`` holds whatever the memory held (TE does the same; FusedAdam never
   reads ``amax``).
4. Dtypes: fp32 states are plain; fp16 states store value/scale with an fp32 ``[1]`` scale in
   ``self._scales[p][name]`` (outside ``state``); bf16 states are plain with an unused ``[1]``
   scale of ones; uint8 states are ``Float8Tensor`` objects (see below) with their own scale.
5. ``get_unscaled_state(p, name)`` returns the LIVE tensor for fp32 and int16 states and a fresh
   fp32 copy for the others; ``set_scaled_state(p, name, t)`` asserts fp32 (int16 for remainders),
   writes in place and updates ``_scales`` in place (and, for fp16, scales ``t`` in place as TE
   does).
6. ``state_dict()`` replaces every state tensor by ``get_unscaled_state`` (so it reads the data of
   every low-precision state); ``load_state_dict()`` lets torch load (and cast) first, then
   replaces each ``state[p]`` by NEW tensors made through ``set_scaled_state`` from the given
   dict, with new ``_scales`` tensors.
7. ``step()``: per group, unscale every low-precision state to fp32 temporaries, run the kernel
   formula, rescale (``_apply_scale``: absmax / range, FP8 quantizer scale = 1/scale). Kernels:
   ``AdamFunctorMaster`` (bf16/fp16 params with a fp32 master: the param is written as the
   master cast to its dtype), ``AdamFunctorMasterParamRemainder`` (bf16 param high bits, minus
   one when the remainder is negative, joined with the int16 remainder; split and rounded back
   after the update) and ``AdamFunctor`` (fp32 params, or no master weights). ``master_param`` of
   fp32 params exists but is never updated. Gradients come from ``p.decoupled_grad`` with
   ``use_decoupled_grad``; parameters without a gradient are skipped after their state exists.
   Kernel lists are rebuilt every step (nothing is cached), so rebinding ``state[p][k]`` between
   steps is safe, and every state tensor is updated in place.
8. ``zero_grad``: ``decoupled_grad = None`` (or zeroed) with ``use_decoupled_grad``.
9. ``Float8Tensor``: a wrapper tensor subclass whose ``.dtype`` reads float32 and whose memory is
   ``_data`` (uint8, the parameter's shape), ``_transpose`` (uint8, the transposed 2-D view; the
   quantizer is created with columnwise usage, so it is allocated and written by every
   quantization), ``_transpose_invalid``, ``_scale_inv`` (fp32 ``[1]``) and ``_quantizer``
   (``Float8Quantizer`` with its own ``scale`` and ``amax``). ``quantize_``/``copy_`` from a plain
   tensor write ``_data`` = e4m3(x * scale) (saturating, like CUDA's satfinite cast),
   ``_scale_inv`` = 1/scale and ``_transpose`` in place, and raise ``amax`` to max(amax, |x|)
   (delayed scaling accumulates amax until a recipe resets it; nothing resets FusedAdam's
   quantizers: an assumption, unverified on TE, harmless since FusedAdam never reads it);
   ``float()``/``dequantize()`` return
   ``_data`` * ``_scale_inv`` as a new plain tensor; other aten ops dequantize first (in-place ops
   quantize the result back), as ``QuantizedTensor.__torch_dispatch__`` does.

Deliberately not reproduced
---------------------------
* Bit-exact agreement with the CUDA kernels (FMA contraction, warp reductions): the double runs
  the same fp32 formula with torch ops, deterministic on a given machine, which is what on-vs-off
  comparisons need. Tests that need the real numerics run on TE itself (``test_te_gpu.py``).
* ``capturable=True`` (CUDA graphs; the offloader refuses ``optimizer_cuda_graph`` anyway),
  FP8 *parameters*, DTensor parameters, FP8 E5M2 moments (TE creates E4M3 only): they raise
  ``NotImplementedError`` instead of doing something plausible.
* Allocation: TE's ``Float8Quantizer.make_empty`` defaults to ``device="cuda"``; the double uses
  the CUDA device when there is one and the CPU otherwise.
"""

from __future__ import annotations

import contextlib
import warnings
from copy import deepcopy
from itertools import chain
from typing import Optional

import torch

# The FP8 tensors live in their own module; their names are part of this double's interface.
from .te_float8 import DType, Float8Quantizer, Float8Tensor, _default_device  # noqa: F401

TE_VERSION = "2.17.1"

# Release lines whose FusedAdam differs in what an offloader sees (read from the sources):
# "2.12" (2.8-2.12): every non-fp32 state is unscaled into an fp32 temporary for the kernel;
# "2.17" (2.13-2.18): with both moments bf16 (``fuse_unscale``) the kernel updates them in
#   place, ``get_unscaled_state`` gains ``skip_unscale``, capturable accepts bf16 moments;
# "2.19" (release_v2.19, main; PR #3318): as "2.17", and ``group["step"]`` advances for
#   empty groups too.
LINES = ("2.12", "2.17", "2.19")
_line = "2.17"  # the line of TE_VERSION


def line_of(version: str) -> str:
    """The double's line for a TE version string ("2.14.0" -> "2.17")."""
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < (2, 13):
        return "2.12"
    return "2.17" if (major, minor) < (2, 19) else "2.19"


@contextlib.contextmanager
def te_line(line: str):
    """FusedAdam objects made inside the block behave as TE's ``line`` (one of ``LINES``)."""
    global _line
    if line not in LINES:
        raise ValueError(f"unknown TE line {line!r}: use one of {LINES}")
    previous, _line = _line, line
    try:
        yield
    finally:
        _line = previous


_UNSET = object()


def _f32(value: float) -> float:
    """``value`` rounded to fp32 (the kernels receive their scalars as C ``float``)."""
    return float(torch.tensor(value, dtype=torch.float32))


# ------------------------------------------------------------------------------- kernels
def _bias_corrections(beta1: float, beta2: float, step: int, bias_correction: int):
    """The host wrapper's ``1 - std::pow(beta, step)`` (float beta, double pow, float result)."""
    if not bias_correction:
        return 1.0, 1.0
    return _f32(1.0 - _f32(beta1) ** step), _f32(1.0 - _f32(beta2) ** step)


def _adam_update(p, g, m, v, *, lr, beta1, beta2, eps, step, mode, bias_correction, decay):
    """One Adam update on fp32 tensors, in place on ``p``, ``m`` and ``v`` (the kernel body)."""
    c1, c2 = _bias_corrections(beta1, beta2, step, bias_correction)
    b1, b2 = _f32(beta1), _f32(beta2)
    one_minus_b1, one_minus_b2 = _f32(1.0 - b1), _f32(1.0 - b2)
    lr, eps, decay = _f32(lr), _f32(eps), _f32(decay)
    fused = [(t, t.float()) for t in (m, v) if t.dtype == torch.bfloat16]
    if fused:
        # Fused bf16 moments (TE >= 2.13): the kernel loads them, computes in fp32 and stores
        # bf16 in place; the fp32 copies here stand for its registers (not device memory).
        m = fused[0][1] if m.dtype == torch.bfloat16 else m
        v = fused[-1][1] if v.dtype == torch.bfloat16 else v
    g = g.float()
    if mode == 0:  # L2 regularization
        g = g + decay * p
    m.mul_(b1).add_(one_minus_b1 * g)
    v.mul_(b2).add_((one_minus_b2 * g) * g)
    update = (m / c1) / ((v / c2).sqrt() + eps)
    if mode == 1:  # decoupled weight decay (AdamW)
        update = update + decay * p
    p.sub_(lr * update)
    for stored, value in fused:
        stored.copy_(value)


def _join_remainder(param_bf16: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """fp32 master from the bf16 param (high bits) and the int16 remainder (low bits)."""
    high = param_bf16.view(torch.int16).to(torch.int32)
    low = remainder.to(torch.int32)
    high = torch.where(low < 0, high - 1, high)  # undo the rounding done when splitting
    bits = (high << 16) | (low & 0xFFFF)
    return bits.view(torch.float32).clone()


def _split_remainder(master: torch.Tensor, param_bf16: torch.Tensor, remainder: torch.Tensor) -> None:
    """Write the bf16 param (rounded to nearest) and the int16 remainder back, in place."""
    bits = master.view(torch.int32)
    high = (bits >> 16).to(torch.int16)
    low = (bits & 0xFFFF).to(torch.int16)
    high = torch.where(low < 0, high + 1, high)  # round up (int16 wrap-around as in CUDA)
    param_bf16.view(torch.int16).copy_(high)
    remainder.copy_(low)


# ----------------------------------------------------------------------------- FusedAdam
class FusedAdam(torch.optim.Optimizer):
    """Transformer Engine's ``FusedAdam`` (TE 2.17), computed with torch ops. See the module doc."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction=True,
        adam_w_mode=True,
        capturable=False,
        master_weights=False,
        master_weight_dtype=torch.float32,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        use_decoupled_grad=False,
        store_param_remainders=False,
        set_grad_none: Optional[bool] = None,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and master_weight_dtype not in [torch.float32, torch.float16]:
            raise RuntimeError("FusedAdam only supports fp32/fp16 master weights.")
        allowed = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]
        if exp_avg_dtype not in allowed:
            raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg.")
        if exp_avg_sq_dtype not in allowed:
            raise RuntimeError("FusedAdam only supports fp32/fp16/bf16/fp8 exp_avg_sq.")
        if capturable and master_weights and master_weight_dtype != torch.float32:
            raise RuntimeError("Capturable mode only supports fp32 master weights.")
        line = _line
        if line == "2.12":
            if capturable and exp_avg_dtype != torch.float32:
                raise RuntimeError("Capturable mode only supports fp32 exp_avg.")
            if capturable and exp_avg_sq_dtype != torch.float32:
                raise RuntimeError("Capturable mode only supports fp32 exp_avg_sq")
        elif capturable and not (
            exp_avg_dtype == exp_avg_sq_dtype == torch.float32
            or exp_avg_dtype == exp_avg_sq_dtype == torch.bfloat16
        ):
            raise RuntimeError(
                "Capturable mode requires exp_avg_dtype and exp_avg_sq_dtype to be "
                "both torch.float32 or both torch.bfloat16, but got "
                f"exp_avg_dtype={exp_avg_dtype} and exp_avg_sq_dtype={exp_avg_sq_dtype}."
            )
        if capturable and store_param_remainders:
            raise RuntimeError("Capturable mode doesn't support storing param remainders")
        if capturable:
            raise NotImplementedError("the FusedAdam double does not reproduce capturable mode")

        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.te_line = line
        # Bytes of the fp32 temporaries the last step() made (unscaled copies of non-fp32
        # states, alive together until the rescale): TE allocates the same on the device.
        self.transient_bytes_last_call = 0
        if line != "2.12":
            # Both moments bf16: the kernel reads and writes them in place (no temporaries).
            self.fuse_unscale = exp_avg_dtype == exp_avg_sq_dtype == torch.bfloat16
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=_default_device())

        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map = {
            "exp_avg": self.exp_avg_dtype,
            "exp_avg_sq": self.exp_avg_sq_dtype,
            "master_param": self.master_weight_dtype,
        }
        self.dtype_to_range_map = {
            torch.float16: torch.full([1], torch.finfo(torch.float16).max / 2.0, dtype=torch.float32),
            torch.uint8: torch.full([1], 448.0, dtype=torch.float32),
        }
        self._scales = {}
        self.use_decoupled_grad = use_decoupled_grad
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        self.set_grad_none = set_grad_none
        if self.set_grad_none is not None:
            warnings.warn(
                "set_grad_none kwarg in FusedAdam constructor is deprecated. "
                "Use set_to_none kwarg in zero_grad instead.",
                DeprecationWarning,
            )

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if self.set_grad_none is not None:
            if set_to_none is not None and set_to_none != self.set_grad_none:
                raise ValueError(
                    f"Called zero_grad with set_to_none={set_to_none}, "
                    f"but FusedAdam was initialized with set_grad_none={self.set_grad_none}"
                )
            set_to_none = self.set_grad_none
        if set_to_none is None:
            set_to_none = True
        if not self.use_decoupled_grad and not set_to_none:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                if self.use_decoupled_grad and set_to_none:
                    p.decoupled_grad = None
                elif self.use_decoupled_grad and not set_to_none:
                    p.decoupled_grad.zero_()
                elif not self.use_decoupled_grad and set_to_none:
                    p.grad = None

    # --------------------------------------------------------------------- scaling
    def _apply_scale(self, state_name, unscaled_state, scaled_state, scale):
        """Write fp32 ``unscaled_state`` into low-precision ``scaled_state``; ``scale`` in place."""
        assert unscaled_state.dtype == torch.float32
        if scaled_state.dtype == torch.bfloat16:
            scaled_state.copy_(unscaled_state.bfloat16())
            return
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.uint8:
            assert isinstance(scaled_state, Float8Tensor)
            assert len(scaled_state._quantizer.scale) == 1, (
                "Only scaling with one scaling factor per tensor is supported by the FusedAdam."
            )
        else:
            assert scaled_state.dtype == dtype
        max_range = self.dtype_to_range_map[dtype]
        if max_range.device != scaled_state.device:
            max_range = max_range.to(scaled_state.device)
            self.dtype_to_range_map[scaled_state.dtype] = max_range
        if unscaled_state.device != scaled_state.device:
            unscaled_state = unscaled_state.to(scaled_state.device)
        min_val, max_val = torch.aminmax(unscaled_state)
        absmax = torch.maximum(-min_val, max_val)
        absmax = absmax.to(dtype=torch.float32, device=unscaled_state.device)
        torch.div(absmax, max_range, out=scale)
        if isinstance(scaled_state, Float8Tensor):
            scaled_state._quantizer.scale.copy_(1 / scale)
            scaled_state.copy_(unscaled_state)
        else:
            rscale = torch.where(scale > 0, scale.reciprocal(), 0.0)
            unscaled_state.mul_(rscale)
            scaled_state.copy_(unscaled_state)

    def get_unscaled_state(self, param, state_name, skip_unscale=_UNSET):
        """The fp32 value of a state: LIVE for fp32/int16 states, a new tensor otherwise
        (TE >= 2.13: with ``skip_unscale=True`` a bf16 state is returned LIVE, in bf16)."""
        if skip_unscale is _UNSET:
            skip_unscale = False
        elif self.te_line == "2.12":
            raise TypeError("get_unscaled_state() got an unexpected keyword argument 'skip_unscale'")
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]
        if dtype == torch.uint8:
            unscaled = state[state_name].float()
        elif dtype == torch.float16:
            assert state[state_name].dtype == torch.float16
            unscaled = state[state_name].float()
            unscaled.mul_(self._scales[param][state_name])
        elif dtype == torch.float32:
            if (
                self.store_param_remainders
                and state_name == "master_param"
                and param.dtype == torch.bfloat16
            ):
                assert state[state_name].dtype == torch.int16
            else:
                assert state[state_name].dtype == torch.float32
            unscaled = state[state_name]
        elif dtype == torch.bfloat16:
            assert state[state_name].dtype == torch.bfloat16
            unscaled = state[state_name] if skip_unscale else state[state_name].float()
        else:
            raise RuntimeError(f"Dtype of {state_name} can only be fp8/fp16/bf16/fp32.")
        return unscaled

    def set_scaled_state(self, param, state_name, unscaled_state):
        """Write an fp32 (int16 for remainders) value into a state, scaling as needed."""
        store_param_remainders = (
            self.store_param_remainders
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
        )
        if store_param_remainders:
            assert unscaled_state.dtype == torch.int16
        else:
            assert unscaled_state.dtype == torch.float32
        state = self.state[param]
        if state_name not in state:
            self._initialize_state(param, state_name, False, store_param_remainders)
        dtype = self.name_to_dtype_map[state_name]
        if dtype != torch.float32:
            scale = self._scales[param]
            self._apply_scale(state_name, unscaled_state, state[state_name], scale[state_name])
        else:
            state[state_name].copy_(unscaled_state)

    # ------------------------------------------------------------------ state creation
    def _initialize_state(self, param, state_name, zero_buffer: bool, store_param_remainders: bool = False):
        dtype = self.name_to_dtype_map[state_name]
        if isinstance(param, Float8Tensor):
            raise NotImplementedError("the FusedAdam double does not reproduce FP8 parameters")
        if store_param_remainders:
            data = torch.zeros_like(param, dtype=torch.int16)
        else:
            data = torch.empty_like(param, dtype=dtype)
        if zero_buffer:
            data.zero_()
        if dtype == torch.uint8:
            quantizer = Float8Quantizer(
                scale=torch.ones([1], dtype=torch.float32, device=param.device),
                amax=torch.zeros([1], dtype=torch.float32, device=param.device),
                fp8_dtype=DType.kFloat8E4M3,
            )
            self.state[param][state_name] = quantizer.make_empty(param.shape)
            self.state[param][state_name].quantize_(data.float())
        else:
            self.state[param][state_name] = data
        if dtype != torch.float32:
            if param not in self._scales:
                self._scales[param] = {}
            self._scales[param][state_name] = torch.ones([1], dtype=torch.float32, device=param.device)

    def initialize_state(self, param, store_param_remainders):
        """Create ``exp_avg``, ``exp_avg_sq`` and (with master weights) ``master_param``."""
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(
                param, "master_param", zero_buffer=False, store_param_remainders=store_param_remainders
            )
            if not store_param_remainders:
                self.set_scaled_state(param, "master_param", param.clone().detach().float())

    # ------------------------------------------------------------------ state dicts
    def state_dict(self):
        """torch's state dict with every state replaced by its unscaled (fp32/int16) value."""
        state_dict = super().state_dict()
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
            )
        )
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                state_dict["state"][k] = {name: self.get_unscaled_state(param, name) for name in v}
        return state_dict

    def load_state_dict(self, state_dict):
        """torch's load, then every state rebuilt (new tensors) through ``set_scaled_state``."""
        super().load_state_dict(state_dict)
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
            )
        )
        for k, v in state_dict["state"].items():
            if k in id_map:
                param = id_map[k]
                self.state[param] = {}
                for name in v:
                    if v[name] is None:
                        continue
                    if (
                        self.store_param_remainders
                        and name == "master_param"
                        and param.dtype == torch.bfloat16
                    ):
                        self.set_scaled_state(param, name, v[name])
                        assert v[name].dtype == torch.int16
                    else:
                        self.set_scaled_state(param, name, v[name].float())

    # ------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scaler is not None:
            raise NotImplementedError("grad_scaler is used by capturable mode only")

        fused = getattr(self, "fuse_unscale", False)
        transient = 0
        for group in self.param_groups:
            if self.te_line == "2.19":
                # TE >= 2.19 advances the count first, so empty groups count steps too.
                group["step"] = group["step"] + 1 if "step" in group else 1
            if len(group["params"]) == 0:
                continue
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            if self.te_line != "2.19":
                if "step" in group:
                    group["step"] += 1
                else:
                    group["step"] = 1

            master_f16, f32 = [], []  # (param, grad, states) per kernel
            rescale = []  # (name, unscaled fp32 temporary, scaled state, scale)
            has_fp16 = has_bf16 = False
            for p in group["params"]:
                state = self.state[p]
                remainders = self.store_param_remainders and p.dtype == torch.bfloat16
                if len(state) == 0:
                    self.initialize_state(p, remainders)
                if self.use_decoupled_grad:
                    grad = p.decoupled_grad if hasattr(p, "decoupled_grad") else None
                else:
                    grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients.")
                unscaled = {}
                for name in ("exp_avg", "exp_avg_sq", "master_param"):
                    if name not in state:
                        continue
                    if name == "master_param" and remainders:
                        unscaled[name] = state[name]
                        assert unscaled[name].dtype == torch.int16
                    elif fused and name != "master_param":
                        unscaled[name] = self.get_unscaled_state(p, name, skip_unscale=True)
                    else:
                        unscaled[name] = self.get_unscaled_state(p, name)
                    if unscaled[name] is not state[name]:
                        transient += unscaled[name].numel() * unscaled[name].element_size()
                    if self.name_to_dtype_map[name] != torch.float32 and unscaled[name] is not state[name]:
                        rescale.append((name, unscaled[name], state[name], self._scales[p][name]))
                if isinstance(p, Float8Tensor):
                    raise NotImplementedError("the FusedAdam double does not reproduce FP8 parameters")
                if p.dtype in (torch.float16, torch.bfloat16):
                    has_fp16 = has_fp16 or p.dtype == torch.float16
                    has_bf16 = has_bf16 or p.dtype == torch.bfloat16
                    master_f16.append((p, grad, unscaled))
                elif p.dtype == torch.float32:
                    f32.append((p, grad, unscaled))
                else:
                    raise RuntimeError("FusedAdam only support model weights in fp32, fp16, bf16 and fp8")
                if has_fp16 and has_bf16:
                    if self.store_param_remainders:
                        raise RuntimeError(
                            "FusedAdam doesn't support a mix of FP16/BF16 weights + Store param"
                            " remainder."
                        )
                    raise RuntimeError(
                        "FusedAdam does not support a mix of float16 and bfloat16 model weights."
                    )

            hyper = dict(
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                step=group["step"],
                mode=self.adam_w_mode,
                bias_correction=bias_correction,
                decay=group["weight_decay"],
            )
            use_remainder_kernel = self.store_param_remainders and has_bf16 and not has_fp16
            for p, grad, states in master_f16:
                if not self.master_weights:  # AdamFunctor on the 16-bit param itself
                    master = p.float()
                    _adam_update(master, grad, states["exp_avg"], states["exp_avg_sq"], **hyper)
                    p.copy_(master)
                elif use_remainder_kernel:  # AdamFunctorMasterParamRemainder
                    master = _join_remainder(p, states["master_param"])
                    _adam_update(master, grad, states["exp_avg"], states["exp_avg_sq"], **hyper)
                    _split_remainder(master, p, states["master_param"])
                else:  # AdamFunctorMaster
                    master = states["master_param"]
                    _adam_update(master, grad, states["exp_avg"], states["exp_avg_sq"], **hyper)
                    p.copy_(master)
            for p, grad, states in f32:  # AdamFunctor; an fp32 param's master_param is unused
                _adam_update(p, grad, states["exp_avg"], states["exp_avg_sq"], **hyper)

            for name in ("exp_avg", "exp_avg_sq", "master_param"):
                for state_name, unscaled, scaled, scale in rescale:
                    if state_name == name:
                        self._apply_scale(name, unscaled, scaled, scale)
        self.transient_bytes_last_call = transient
        return loss


class FusedSGD(torch.optim.SGD):
    """Placeholder for ``transformer_engine.pytorch.optimizers.FusedSGD`` (not reproduced)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the Transformer Engine double reproduces FusedAdam only")
