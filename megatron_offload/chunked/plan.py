"""The chunked update's budget and plan: what fits in a slot, and what each step does.

Budget: every parameter's states are sized at attach from the optimizer's own configuration
(``inner_optimizers.planned_state_bytes``: exact for torch's, apex's and TE's Adam), and a
budget one of them cannot fit in is refused there. The budget also holds the fp32
temporaries TE's ``step`` makes per call for its FP8/fp16 (and, before TE 2.13, bf16) states
(``inner_optimizers.transient_bytes``): it is split into the slots and a reserve that grows
with them. With ``ratio`` the largest temporaries/state-bytes ratio, a chunk that fits a
slot makes at most ``ratio * slot_bytes`` of temporaries, so the update never holds more
than ``slots * slot_bytes + reserve <= chunked_update_bytes``.

The plan of each step (``update.ChunkedUpdate``'s ``_plan``) is worked out again only when the
states or the engine's groups changed.
"""

from __future__ import annotations

from ..adapters import MASTER_WEIGHTS, OPTIMIZER_STATES, inner_optimizers
from ..engine import SlotSizeError
from ..engine.slots import budget_for

#: Host bytes the undo reserves per parameter for the small tensors its state keeps on the
#: device (torch Adam's step count, Transformer Engine's FP8 scales: 16 bytes each, aligned).
SMALL_STATE_ROOM = 128


def planned(inner, param, kinds) -> tuple[int, bool]:
    """(slot bytes of ``param``'s states before they exist, exact?) for the offloaded kinds."""
    return inner_optimizers.planned_state_bytes(
        inner, param, moments=OPTIMIZER_STATES in kinds, masters=MASTER_WEIGHTS in kinds
    )


def transient_ratio(inner, params, kinds) -> float:
    """Largest ratio of an update call's temporary bytes to the slot bytes of the states it
    updates (Transformer Engine's fp32 temporaries; 0 for other optimizers)."""
    ratio = 0.0
    for param in params:
        need, _ = planned(inner, param, kinds)
        extra = inner_optimizers.transient_bytes(inner, param)
        if need and extra:
            ratio = max(ratio, extra / need)
    return ratio


class Budget:
    """``total_bytes`` split into ``slots`` slots and a reserve for the optimizer's
    temporaries; refuses (``ValueError``) a budget some parameter's states cannot fit in."""

    def __init__(self, inner, kinds, *, total_bytes: int, slots: int) -> None:
        self.inner, self.kinds = inner, tuple(kinds)
        params = [p for group in inner.param_groups for p in group["params"]]
        self.ratio = transient_ratio(inner, params, self.kinds)
        self.slots = slots
        self.slot_bytes = int(total_bytes // (slots + self.ratio))
        self.reserve = total_bytes - slots * self.slot_bytes
        #: Slot bytes of every parameter's states (what an undo journal saves of them).
        self.planned = 0
        for param in params:
            need, exact = planned(inner, param, self.kinds)
            self.planned += need
            if need > self.slot_bytes:
                raise ValueError(
                    f"chunked_update_bytes={total_bytes} gives {slots} slot(s) of "
                    f"{self.slot_bytes:,} bytes"
                    + (
                        f" (and {self.reserve:,} bytes for the optimizer's temporary fp32 "
                        "copies during each update call)"
                        if self.ratio
                        else ""
                    )
                    + f", but the states of the parameter shard {tuple(param.shape)} take "
                    f"{'' if exact else 'at least '}{need:,} bytes: give at least "
                    f"{budget_for(need, slots, self.ratio):,} bytes, or leave "
                    "chunked_update_bytes unset."
                )

    def check_new_states(self, param, name: str) -> None:
        """Refuse, before any update, a parameter whose states (made at this step) or the
        temporaries of their update do not fit."""
        self.check_transients(inner_optimizers.transient_bytes(self.inner, param), param.shape)
        need, exact = planned(self.inner, param, self.kinds)
        if need > self.slot_bytes:
            raise SlotSizeError(
                f"{name}: the states that parameter {tuple(param.shape)} creates at this step "
                f"take {'' if exact else 'at least '}{need:,} bytes, more than one slot of the "
                f"chunked update ({self.slot_bytes:,} bytes); no parameter was updated. Give "
                f"the chunked update at least {budget_for(need, self.slots, self.ratio):,} "
                "bytes (chunked_update_bytes), or leave it unset."
            )

    def check_transients(self, nbytes: int, shape, count: int = 1, *, name: str = "") -> None:
        """Refuse, before any update, a call whose temporaries exceed the reserve."""
        if nbytes <= self.reserve:
            return
        params = [p for group in self.inner.param_groups for p in group["params"]]
        ratio = transient_ratio(self.inner, params, self.kinds)
        raise SlotSizeError(
            f"{name + ': ' if name else ''}the optimizer's temporary fp32 copies for "
            f"{'parameter' if count == 1 else f'{count} parameters from'} {tuple(shape)} take "
            f"{nbytes:,} bytes during one update call, more than the {self.reserve:,} "
            "bytes chunked_update_bytes keeps for them (split when attaching, from the parameters "
            "then; a param group added since needs more); no parameter was updated. Attach again, "
            f"with at least {budget_for(self.slot_bytes, self.slots, ratio):,} bytes "
            "(chunked_update_bytes), or leave it unset."
        )
