"""Parameters and a torch AdamW with a ``collect()`` in the shape the adapters produce, for
tests that drive the engine directly."""

from __future__ import annotations

import torch

STATES, MASTERS = "optimizer_states", "master_weights"


class AdamWModel:
    """One parameter per ``(shape, dtype)``; ``collect()`` yields the parameters as master
    weights, then the moments as optimizer states. The gradients of step ``index`` depend only
    on the index and the parameter's position (seed ``grad_seed * index + position``)."""

    def __init__(self, shapes, seed: int = 0, grad_seed: int = 1000) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [
            torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            for shape, dtype in shapes
        ]
        self.opt = torch.optim.AdamW(self.params, lr=0.01)
        self.grad_seed = grad_seed

    def collect(self):
        for p in self.params:
            yield MASTERS, p
        for p in self.params:
            state = self.opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    yield STATES, state[key]

    def step(self, index: int) -> None:
        for j, p in enumerate(self.params):
            gen = torch.Generator().manual_seed(self.grad_seed * index + j)
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        self.opt.step()

    def tensors(self) -> list:
        return [t for _, t in self.collect()]

    def snapshot(self) -> list:
        return [t.detach().clone() for t in self.tensors()]


def two_group_adamw(sizes, seed: int = 0):
    """Parameters of ``sizes`` alternating fp32 and fp64 (two groups: a chunk of the chunked
    update moves two segments) and their torch AdamW: ``(params, optimizer)``."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.float64)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=gen).to(dtypes[i % 2]))
        for i, n in enumerate(sizes)
    ]
    return params, torch.optim.AdamW(params, lr=0.01)


def seeded_grads(params, step: int) -> None:
    """Gradients that depend only on the step and the parameter's position."""
    for j, p in enumerate(params):
        gen = torch.Generator().manual_seed(10 * step + j)
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
