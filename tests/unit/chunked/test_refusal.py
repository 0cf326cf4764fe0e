"""The chunked update refuses a budget before it touches anything, and streams every TE line.

Driven directly (an engine and a ``ChunkedUpdate`` around one inner optimizer, as in
``test_chunked_errors.py``) on the checked device, in the isolated process (a released state
touched by mistake would crash the process). Three optimizer kinds: torch AdamW, the apex
FusedAdam double and the Transformer Engine FusedAdam double (bf16 parameters, decoupled fp32
gradients, master weights in the state, as megatron-core's precision-aware path uses it).

* A budget that cannot hold one parameter's states (sized from the optimizer's configuration:
  TE's 4-12 bytes per element, not a guessed 2) is refused by the constructor.
* A parameter group added after attaching, too large for a slot, is refused at the step
  before any parameter is updated: parameters, group steps and every existing state are
  bitwise as they were, and the same step retried with a larger budget gives the bytes of
  a run that never failed.
* For each TE line of the double (2.8-2.12, 2.13-2.18, 2.19+), FP8/bf16/fp32 moments, with and
  without remainders, and an empty param group, the chunked steps equal whole steps byte
  for byte; the memory each call holds (slots, states in the optimizer, and the double's
  fp32 temporaries) stays within ``chunked_update_bytes``.
"""

from __future__ import annotations

import types

import pytest
import torch

STATES, MASTERS = "optimizer_states", "master_weights"
SIZES = (40, 7, 33, 16, 5, 24)


def _build(kind, moments="fp32", remainders=True, line="2.17", empty_group=False, sizes=SIZES):
    from tests.harness.doubles import apex_fused_adam, te_fused_adam

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if kind == "te" else torch.float32
    params = [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.1).to(dtype)) for n in sizes]
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": 0.02}]
    if empty_group:
        groups.insert(1, {"params": []})
    if kind == "torch":
        return params, torch.optim.AdamW(groups, lr=0.01)
    if kind == "apex":
        return params, apex_fused_adam.FusedAdam(groups, lr=0.01)
    m = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}[
        moments
    ]
    with te_fused_adam.te_line(line):
        opt = te_fused_adam.FusedAdam(
            groups,
            lr=0.01,
            weight_decay=0.1,
            master_weights=True,
            exp_avg_dtype=m,
            exp_avg_sq_dtype=m,
            use_decoupled_grad=True,
            store_param_remainders=remainders,
        )
    return params, opt


def _grads(kind, params, step):
    for j, p in enumerate(params):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + j))
        if kind == "te":
            p.decoupled_grad = g * 0.01
        else:
            p.grad = g.to(p.dtype)


def _snapshot(opt) -> dict:
    """Bytes of every parameter, group step and state buffer (FP8 internals included)."""
    from tests.harness.doubles.te_fused_adam import Float8Tensor

    out = {}
    for g, group in enumerate(opt.param_groups):
        out[(g, "step")] = repr(group.get("step"))
        for i, p in enumerate(group["params"]):
            out[(g, i, "param")] = _bytes(p)
            for key, value in sorted((opt.state.get(p) or {}).items()):
                if isinstance(value, Float8Tensor):
                    for attr in ("_data", "_transpose", "_scale_inv"):
                        out[(g, i, key, attr)] = _bytes(getattr(value, attr))
                    out[(g, i, key, "scale")] = _bytes(value._quantizer.scale)
                elif isinstance(value, torch.Tensor):
                    out[(g, i, key)] = _bytes(value)
                else:
                    out[(g, i, key)] = repr(value)
            for key, scale in sorted(getattr(opt, "_scales", {}).get(p, {}).items()):
                out[(g, i, key, "_scales")] = _bytes(scale)
    return out


def _bytes(tensor) -> bytes:
    # Bytes, not values: an all-zero FP8 moment holds NaN (TE's scale of 0), and NaN != NaN.
    return bytes(tensor.detach().reshape(-1).contiguous().view(torch.uint8).tolist())


class _Run:
    """An engine and a chunked update around ``opt``; ``step()`` runs one automatic cycle."""

    def __init__(self, opt, budget, kinds, device=None, undo=True):
        from megatron_offload.adapters import megatron_wrappers as adapter
        from megatron_offload.chunked.update import ChunkedUpdate
        from megatron_offload.engine import OffloadEngine
        from megatron_offload_testing import CheckedDevice

        self.distrib = types.SimpleNamespace(optimizer=opt)
        self.device = CheckedDevice() if device is None else device
        self.engine = OffloadEngine(
            self.device,
            lambda: adapter.collect(self.distrib),
            streamed=lambda: adapter.in_state(self.distrib),
        )
        self.chunked = ChunkedUpdate(
            self.engine, self.distrib, total_bytes=budget, slots=2, kinds=kinds, undo=undo
        )
        self.chunked.install()
        self.peaks, self.transients = [], []
        opt.register_step_post_hook(self._measure)

    def _measure(self, inner, args, kwargs):
        from megatron_offload.adapters import inner_optimizers

        held = {}
        for group in inner.param_groups:
            for p in group["params"]:
                for _, t in inner_optimizers.state_tensors(p, inner.state.get(p) or {}):
                    held[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        params = self._param_storages
        for mem in self.device._memories.values():
            storage = mem.storage()
            if not mem.host and storage is not None and storage._cdata not in params:
                held[storage._cdata] = storage.nbytes()
        # The double's fp32 temporaries of that call: TE allocates them on the device too.
        self.transients.append(getattr(inner, "transient_bytes_last_call", 0))
        self.peaks.append(sum(held.values()) + self.transients[-1])

    def step(self):
        # The parameters and the small tensors their states keep on the device (step counts,
        # scales) are not the update's memory; the undo's copies of them make the device know
        # them. (Taken before the step: during it, the param groups are narrowed to each call's.)
        from megatron_offload.adapters.inner_optimizers import written_tensors
        from megatron_offload.phase import Phase

        opt = self.distrib.optimizer
        self._param_storages = {
            t.untyped_storage()._cdata
            for g in opt.param_groups
            for p in g["params"]
            for t in written_tensors(opt, p, opt.state.get(p))
            if t.numel() < 2 or t is p
        }
        token = self.chunked.phase.enter(Phase.STEPPING)
        try:
            self.distrib.optimizer.step()
        finally:
            self.chunked.phase.leave(token)
            self.engine.offload(skip_unchanged=True)
            self.engine.release()

    def reload(self):
        self.engine.reload()
        self.engine.wait()

    def close(self):
        self.engine.close()
        self.chunked.remove()
        self.device.check()


def _kinds(kind):
    return (STATES, MASTERS) if kind == "te" else (STATES,)


def _per_param_need(opt, kind, slots=2):
    """The budget the largest parameter needs (what the refusal message asks for)."""
    import math

    from megatron_offload.adapters import inner_optimizers

    params = [p for g in opt.param_groups for p in g["params"]]
    planned = [
        inner_optimizers.planned_state_bytes(opt, p, moments=True, masters=kind == "te")[0]
        for p in params
    ]
    ratio = max(
        (inner_optimizers.transient_bytes(opt, p) / n for p, n in zip(params, planned) if n),
        default=0.0,
    )
    return -(-math.ceil(max(planned) * (slots + ratio)) // 16) * 16, planned


def _refused_step(run, opt):
    """(the ValueError the step raised or None, snapshot before, snapshot after); closes ``run``."""
    run.reload()
    before = _snapshot(opt)
    run.engine.offload(skip_unchanged=True)
    run.engine.release()
    error = None
    try:
        run.step()
    except ValueError as exc:
        error = exc
    run.reload()
    after = _snapshot(opt)
    run.close()
    return error, before, after


# ----------------------------------------------------------------------- refusals
def run_attach_refusal(kind, moments):
    params, opt = _build(kind, moments)
    need, planned = _per_param_need(opt, kind)
    before = _snapshot(opt)
    try:
        _Run(opt, need - 16, _kinds(kind))
    except ValueError as error:
        refused = str(error)
    else:
        refused = None
    run = _Run(opt, need, _kinds(kind))  # exactly the size asked for is accepted
    _grads(kind, params, 0)
    run.step()
    run.reload()
    actual = []
    from megatron_offload.adapters import inner_optimizers

    for p in params:
        actual.append(
            sum(
                -(-t.numel() * t.element_size() // 16) * 16
                for _, t in inner_optimizers.state_tensors(p, opt.state[p])
            )
        )
    run.close()
    return {
        "refused": refused,
        "need": need,
        "planned": planned,
        "actual": actual,
        "untouched": before == _snapshot(_build(kind, moments)[1])
        and len(opt.state) == len(params),
    }


@pytest.mark.parametrize(
    "kind,moments",
    [
        ("torch", "fp32"),
        ("apex", "fp32"),
        ("te", "fp32"),
        ("te", "fp8"),
        ("te", "bf16"),
        ("te", "fp16"),
    ],
)
def test_a_budget_one_parameter_cannot_fit_is_refused_at_attach(isolated, kind, moments):
    out = isolated.run(run_attach_refusal, kind, moments)
    assert out["refused"] is not None and f"give at least {out['need']:,} bytes" in out["refused"]
    # The sizes were known exactly before the states existed.
    assert out["planned"] == out["actual"], (out["planned"], out["actual"])
    if kind == "te":
        # 2 (bf16/fp8 data+transpose) to 4 bytes per moment element plus an int16 remainder:
        # far above the 2 bytes per element a guess would give.
        assert min(n / s for n, s in zip(out["actual"], SIZES)) > 4


def run_step_refusal(kind, moments, remainders):
    """Attach with a budget that fits, train, add a group too large for a slot, step."""
    params, opt = _build(kind, moments, remainders)
    ref_params, ref_opt = _build(kind, moments, remainders)
    need, _ = _per_param_need(opt, kind)
    run = _Run(opt, need, _kinds(kind))
    for step in range(2):
        _grads(kind, params, step)
        _grads(kind, ref_params, step)
        run.step()
        ref_opt.step()
    dtype = params[0].dtype
    big = torch.nn.Parameter((torch.ones(4 * max(SIZES)) * 0.1).to(dtype))
    ref_big = torch.nn.Parameter(big.detach().clone())
    opt.add_param_group({"params": [big]})
    ref_opt.add_param_group({"params": [ref_big]})
    for p in (big, ref_big):
        _grads(kind, [p], 7)
    _grads(kind, params, 2)
    _grads(kind, ref_params, 2)
    error, before, after = _refused_step(run, opt)
    error = error and f"{type(error).__name__}: {error}"
    # Retry the same step with a budget that fits the new group (what the message asks for).
    need_big, _ = _per_param_need(opt, kind)
    retry = _Run(opt, need_big, _kinds(kind))
    retry.step()
    ref_opt.step()
    retry.reload()
    result = _snapshot(opt) == _snapshot(ref_opt)
    retry.close()
    changed = [k for k in before if before[k] != after.get(k)]
    return {
        "error": error,
        "changed": [repr(k) for k in changed],
        "same_keys": before.keys() == after.keys(),
        "retry_equals_reference": result,
    }


@pytest.mark.parametrize(
    "kind,moments,remainders",
    [
        ("torch", "fp32", False),
        ("apex", "fp32", False),
        ("te", "fp8", True),
        ("te", "bf16", False),
        ("te", "fp32", True),
    ],
)
def test_a_step_refused_part_way_touches_nothing_and_can_be_retried(
    isolated, kind, moments, remainders
):
    out = isolated.run(run_step_refusal, kind, moments, remainders)
    assert out["error"] is not None and "no parameter was updated" in out["error"], out["error"]
    assert out["same_keys"] and out["changed"] == [], out["changed"][:5]
    assert out["retry_equals_reference"]


def run_new_group_temporaries():
    """Attach with small parameters (TE's temporaries per state byte are lowest there), add a
    group whose temporaries need more than the reserve split off at attach, step."""
    import re

    from megatron_offload.adapters import inner_optimizers

    small = (5, 7, 3)
    params, opt = _build("te", "fp8", True, sizes=small)
    ref_params, ref_opt = _build("te", "fp8", True, sizes=small)
    big = torch.nn.Parameter((torch.ones(64) * 0.1).to(torch.bfloat16))
    ref_big = torch.nn.Parameter(big.detach().clone())
    slot = inner_optimizers.planned_state_bytes(opt, big, moments=True, masters=True)[0]
    _, planned = _per_param_need(opt, "te")
    ratio = max(inner_optimizers.transient_bytes(opt, p) / n for p, n in zip(params, planned))
    budget = -(-int(slot * (2 + ratio) + 1) // 16) * 16  # a slot holds the new parameter's states
    run = _Run(opt, budget, _kinds("te"))
    for step in range(2):
        _grads("te", params, step)
        _grads("te", ref_params, step)
        run.step()
        ref_opt.step()
    opt.add_param_group({"params": [big]})
    ref_opt.add_param_group({"params": [ref_big]})
    _grads("te", [big], 7)
    _grads("te", [ref_big], 7)
    _grads("te", params, 2)
    _grads("te", ref_params, 2)
    error, before, after = _refused_step(run, opt)
    error = error and str(error)
    asked = (
        int(re.search(r"with at least ([\d,]+) bytes", error or "").group(1).replace(",", ""))
        if error
        else 0
    )
    retry = _Run(opt, asked, _kinds("te"))
    retry.step()
    ref_opt.step()
    retry.reload()
    equal = _snapshot(opt) == _snapshot(ref_opt)
    within = max(retry.peaks) <= asked
    retry.close()
    return {
        "error": error,
        "changed": [repr(k) for k in before if before[k] != after.get(k)],
        "retry_equals_reference": equal,
        "within": within,
        "transients": retry.transients,
    }


def test_a_group_added_later_whose_temporaries_exceed_the_reserve_is_refused(isolated):
    out = isolated.run(run_new_group_temporaries)
    assert out["error"] is not None and "temporary fp32 copies" in out["error"], out["error"]
    assert "no parameter was updated" in out["error"]
    assert out["changed"] == [], out["changed"][:5]
    # Attached again with the budget the message asks for: bitwise, and within it.
    assert out["retry_equals_reference"] and out["within"] and max(out["transients"]) > 0


# -------------------------------------------------------------- each TE line, bitwise
def run_lines(line, moments, remainders, fraction):
    params, opt = _build("te", moments, remainders, line, empty_group=True)
    ref_params, ref_opt = _build("te", moments, remainders, line, empty_group=True)
    need, planned = _per_param_need(opt, "te")
    budget = max(need, int(fraction * sum(planned) * 2))
    run = _Run(opt, budget, _kinds("te"))
    for step in range(4):
        _grads("te", params, step)
        _grads("te", ref_params, step)
        if step == 2:  # a parameter without a gradient in one step
            params[1].decoupled_grad = ref_params[1].decoupled_grad = None
        run.step()
        ref_opt.step()
    run.reload()
    a, b = _snapshot(opt), _snapshot(ref_opt)
    out = {
        "different": [repr(k) for k in a if a[k] != b[k]],
        "budget": budget,
        "peaks": run.peaks,
        "steps": [g.get("step") for g in opt.param_groups],
        "chunks": run.engine.copies.last.update_chunks,
        "transient": max(run.transients),
    }
    run.close()
    return out


@pytest.mark.parametrize("line", ["2.12", "2.17", "2.19"])
@pytest.mark.parametrize(
    "moments,remainders",
    [
        ("fp8", True),
        ("fp8", False),
        ("bf16", True),
        ("bf16", False),
        ("fp16", True),
        ("fp32", True),
    ],
)
def test_chunked_steps_equal_whole_steps_in_every_te_line(isolated, line, moments, remainders):
    out = isolated.run(run_lines, line, moments, remainders, 0.3)
    assert out["different"] == [], out["different"][:5]
    assert out["chunks"] >= 2  # really streamed in several calls
    assert max(out["peaks"]) <= out["budget"], (out["peaks"], out["budget"])
    # The empty group's count: advanced by every step from 2.19 on only.
    assert out["steps"] == [4, 4 if line == "2.19" else None, 4]
    fused = moments == "bf16" and line != "2.12"
    assert (out["transient"] == 0) == (fused or moments == "fp32")
