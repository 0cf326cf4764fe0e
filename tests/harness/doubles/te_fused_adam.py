"""A CPU double of Transformer Engine's ``FusedAdam`` (TE 2.17) and of its FP8 ``Float8Tensor``.

Transformer Engine cannot be installed without CUDA, yet production megatron-core steps with its
``FusedAdam``, and with ``--use-precision-aware-optimizer`` the fp32 master weights live in that
optimizer's state. This double reproduces, in plain torch on any device, everything that decides
where TE keeps its tensors and how they are read and written, so that an offloader's TE path can
be exercised with megatron-core's own precision-aware code.

The double is split in three modules; callers import everything from this one, which holds the
optimizer classes, the release lines, and re-exports the names of the other two:
``te_adam_states.py`` (how states are made, scaled, read, written, saved and loaded:
behaviours 2 to 6 below, which ``FusedAdam`` inherits) and ``te_adam_math.py`` (the Adam
kernel formula and the bf16 param remainders). The FP8 tensors are in ``te_float8.py``.

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
  ``tests/harness/doubles/te_float8.py``, whose names this module re-exports).

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
from typing import Optional

import torch

from .te_adam_math import _adam_update, _join_remainder, _split_remainder
from .te_adam_states import FusedAdamStates

# The FP8 tensors live in their own module; their names are part of this double's interface.
from .te_float8 import DType, Float8Quantizer, Float8Tensor, _default_device

# What callers import from here (apex_fused_adam.py also imports ``_adam_update``).
__all__ = [
    "FusedAdam",
    "FusedSGD",
    "TE_VERSION",
    "LINES",
    "line_of",
    "te_line",
    "DType",
    "Float8Quantizer",
    "Float8Tensor",
]


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


# ----------------------------------------------------------------------------- FusedAdam
class FusedAdam(FusedAdamStates):
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
            torch.float16: torch.full(
                [1], torch.finfo(torch.float16).max / 2.0, dtype=torch.float32
            ),
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
                    if (
                        self.name_to_dtype_map[name] != torch.float32
                        and unscaled[name] is not state[name]
                    ):
                        rescale.append((name, unscaled[name], state[name], self._scales[p][name]))
                if isinstance(p, Float8Tensor):
                    raise NotImplementedError(
                        "the FusedAdam double does not reproduce FP8 parameters"
                    )
                if p.dtype in (torch.float16, torch.bfloat16):
                    has_fp16 = has_fp16 or p.dtype == torch.float16
                    has_bf16 = has_bf16 or p.dtype == torch.bfloat16
                    master_f16.append((p, grad, unscaled))
                elif p.dtype == torch.float32:
                    f32.append((p, grad, unscaled))
                else:
                    raise RuntimeError(
                        "FusedAdam only support model weights in fp32, fp16, bf16 and fp8"
                    )
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
