"""Options of the offloader: one dataclass, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable


@dataclass
class OffloadConfig:
    """What to offload and how. Every field is keyword-only when passed to ``attach``."""

    offload_optimizer_states: bool = True
    """Offload the inner optimizer's per-parameter tensors (Adam's ``exp_avg``/``exp_avg_sq``)."""

    offload_primary_weights: bool = True
    """Offload the fp32 master weights (only exist for bf16/fp16 models: fp32 models have
    their master weights in the model parameters, which the forward pass needs)."""

    release_master_grads: bool = True
    """After the step, drop the ``.grad`` of master-weight shards, as ``zero_grad`` would
    before the next iteration; with bf16 gradients it is an fp32 copy worth 4 bytes per
    parameter that otherwise stays on the device between iterations."""

    device_factory: Callable[[Any], Any] | None = None
    """Advanced/testing: ``device_factory(torch_device) -> megatron_offload.device.Device``
    replaces the device layer picked from the parameters' device."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the bad option and what to pass instead."""
        for name in ("offload_optimizer_states", "offload_primary_weights", "release_master_grads"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"OffloadConfig.{name} must be True or False, got {value!r}.")
        if self.device_factory is not None and not callable(self.device_factory):
            raise TypeError("OffloadConfig.device_factory must be callable(torch_device) -> Device.")

    @classmethod
    def from_options(cls, config: "OffloadConfig | None" = None, **options) -> "OffloadConfig":
        """A config from an optional base config and keyword overrides, refusing unknown names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown offload option(s) {', '.join(unknown)}; valid options are "
                f"{', '.join(sorted(known))}."
            )
        base = {f.name: getattr(config, f.name) for f in fields(cls)} if config else {}
        base.update(options)
        return cls(**base)

    def kinds(self) -> tuple[str, ...]:
        from .adapters import OPTIMIZER_STATES, PRIMARY_WEIGHTS

        selected = []
        if self.offload_optimizer_states:
            selected.append(OPTIMIZER_STATES)
        if self.offload_primary_weights:
            selected.append(PRIMARY_WEIGHTS)
        return tuple(selected)
