"""A minimal CPU double of apex's ``FusedAdam`` (``apex/optimizers/fused_adam.py``).

megatron-core picks apex's FusedAdam when Transformer Engine is missing and apex is installed.
Only what decides where its tensors are is reproduced:

1. ``state[p]`` holds ``exp_avg`` and ``exp_avg_sq`` (fp32, ``zeros_like(p).float()``), created
   in ``step()`` and ONLY for parameters that have a gradient at that step: a parameter that never
   had one has no state (unlike TE's FusedAdam, which creates state for every parameter).
2. No per-parameter step: ``group["step"]`` is a Python int, +1 per ``step()`` for every group.
3. ``zero_grad()`` sets ``p.grad = None`` (``set_grad_none=True``, the default).
4. The update is the ``AdamFunctor`` formula (the same as Transformer Engine's) in fp32.

Not reproduced: ``capturable`` and apex's own master weights (``param_groups_master``, which
megatron-core never enables); both raise ``NotImplementedError``.
"""

from __future__ import annotations

import torch

from .te_fused_adam import _adam_update


class FusedAdam(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or master_weights:
            raise NotImplementedError("the apex FusedAdam double reproduces the default mode only")
        defaults = dict(
            lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.capturable = capturable

    def zero_grad(self, set_to_none=None):
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad(set_to_none=False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data).float()
                    state["exp_avg_sq"] = torch.zeros_like(p.data).float()
                if p.dtype != torch.float32:
                    raise NotImplementedError("the apex double updates fp32 parameters only")
                _adam_update(
                    p.data,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    step=group["step"],
                    mode=self.adam_w_mode,
                    bias_correction=1 if group["bias_correction"] else 0,
                    decay=group["weight_decay"],
                )
        return loss
