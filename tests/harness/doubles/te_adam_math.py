"""The Adam kernel formula of the Transformer Engine FusedAdam double and its bf16 remainders.

Split from ``te_fused_adam.py`` (which re-exports ``_adam_update``, also used by
``apex_fused_adam.py``): its module doc lists what is read from TE's
``transformer_engine/common/multi_tensor/adam.cu`` and why the numerics are not bit-exact;
``FusedAdam.step`` there chooses the kernel (behaviour 7 of its list).
"""

from __future__ import annotations

import torch


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


def _split_remainder(
    master: torch.Tensor, param_bf16: torch.Tensor, remainder: torch.Tensor
) -> None:
    """Write the bf16 param (rounded to nearest) and the int16 remainder back, in place."""
    bits = master.view(torch.int32)
    high = (bits >> 16).to(torch.int16)
    low = (bits & 0xFFFF).to(torch.int16)
    high = torch.where(low < 0, high + 1, high)  # round up (int16 wrap-around as in CUDA)
    param_bf16.view(torch.int16).copy_(high)
    remainder.copy_(low)
