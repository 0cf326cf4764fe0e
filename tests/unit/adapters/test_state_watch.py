"""The state fingerprint (``adapters/megatron_wrappers.py``): every layout change seen, in O(groups).

An engine with the offloader's fingerprint (``StateWatch``) over an object shaped like a
DistributedOptimizer (a torch AdamW inside, fp32 masters beside it), trained beside a
reference without offloading. Nothing here calls ``invalidate()``: the fingerprint alone must
see the states Adam creates lazily (for the parameters with a gradient, at their first step),
a ``load_state_dict`` putting new tensors in, a parameter group added, a group's parameter
list and the masters replaced. A constant fingerprint misses them (negative control). Then
the cost: in a steady cycle the watch touches no per-parameter state dict, and the master
gradients are dropped only when a master holds one.

Bodies that read states after a reload run in the isolated process.
"""

from __future__ import annotations

import collections
import copy

import torch

from megatron_offload.adapters import collect as adapter_collect
from megatron_offload.adapters.megatron_wrappers import StateWatch
from megatron_offload.device import CPUDevice
from megatron_offload.engine import OffloadEngine


class Owner:
    """A DistributedOptimizer's shape: ``optimizer`` (AdamW) and ``shard_fp32_from_float16_groups``."""

    def __init__(self, sizes=(5, 7, 3, 11, 4, 6), seed=0, state_dict_type=None):
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        self.optimizer = torch.optim.AdamW(self.params, lr=0.01)
        if state_dict_type is not None:
            self.optimizer.state = collections.defaultdict(state_dict_type)
        self.shard_fp32_from_float16_groups = [[torch.randn(n, generator=gen) for n in sizes]]

    def step(self, step, which=None):
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for j, p in enumerate(params):
            chosen = which is None or j in which
            gen = torch.Generator().manual_seed(100 * step + j)
            p.grad = torch.randn(p.shape, generator=gen) if chosen else None
        self.optimizer.step()
        with torch.no_grad():
            for master in self.shard_fp32_from_float16_groups[0]:
                master.mul_(0.5).add_(step)  # stands for megatron's copy into the masters

    def snapshot(self):
        out = [p.detach().clone() for group in self.optimizer.param_groups for p in group["params"]]
        out += [m.clone() for group in self.shard_fp32_from_float16_groups for m in group]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for _, value in sorted(self.optimizer.state.get(p, {}).items()):
                    out.append(value.clone())
        return out


def _tracked_and_freed(engine, owner):
    """Is every tensor collect finds tracked by the engine and without device memory?"""
    tensors = [t for _, t in adapter_collect(owner)]
    return all(engine.locate(t) is not None for t in tensors) and all(
        t.untyped_storage().nbytes() == 0 for t in tensors
    ), len(tensors)


def run_layout_changes(constant: bool = False) -> dict:
    ref, off = Owner(), Owner()
    walks = []

    def collect():
        walks.append(1)
        return adapter_collect(off)

    watch = StateWatch(off)
    engine = OffloadEngine(CPUDevice(), collect, fingerprint=(lambda: 0) if constant else watch)
    seen = {}
    step = 0

    def cycle(name, which=None, before=None):
        nonlocal step
        if engine.is_released():
            engine.reload()
            engine.wait()
        for model in (ref, off):
            if before is not None:
                before(model)
            model.step(step, which)
        step += 1
        engine.mark_dirty()
        engine.offload(release=True)
        seen[name] = _tracked_and_freed(engine, off)

    cycle("first step, half the parameters", which={0, 2, 4})  # Adam's states, lazily
    cycle("the other half's first step")
    walks_before = len(walks)
    for i in range(3):
        cycle(f"steady {i}")
    steady_walks = len(walks) - walks_before

    def reload_state(model):  # new tensors (and a new mapping) with the same values
        model.optimizer.load_state_dict(copy.deepcopy(model.optimizer.state_dict()))

    cycle("load_state_dict", before=reload_state)

    def add_group(model):
        extra = torch.nn.Parameter(torch.linspace(-1, 1, 9))
        model.optimizer.add_param_group({"params": [extra]})

    cycle("param group added", before=add_group)

    def replace_params(model):  # the group's list replaced, same length, other parameter
        group = model.optimizer.param_groups[0]
        group["params"] = group["params"][:-1] + [torch.nn.Parameter(torch.linspace(2, 3, 8))]

    cycle("a group's parameters replaced", before=replace_params)

    def replace_masters(model):
        model.shard_fp32_from_float16_groups[0] = [
            m.clone() for m in model.shard_fp32_from_float16_groups[0]
        ]

    cycle("masters replaced", before=replace_masters)
    engine.reload()
    engine.wait()
    bitwise = [torch.equal(a, b) for a, b in zip(ref.snapshot(), off.snapshot())]
    engine.close()
    return {
        "seen": seen,
        "steady_walks": steady_walks,
        "bitwise": all(bitwise) and len(bitwise) > 0,
        "looks": watch.looks,
    }


def test_every_layout_change_is_seen_by_the_fingerprint_alone(isolated):
    out = isolated.run(run_layout_changes)
    for name, (tracked_and_freed, count) in out["seen"].items():
        assert tracked_and_freed, (
            f"{name}: some tensor is not tracked or still holds memory ({out})"
        )
    counts = {name: count for name, (_, count) in out["seen"].items()}
    assert counts["first step, half the parameters"] == 6 + 2 * 3  # masters + the moments made
    assert counts["the other half's first step"] == 6 + 2 * 6
    assert counts["param group added"] == counts["load_state_dict"] + 2
    assert out["steady_walks"] == 0  # an unchanged state is not walked
    assert out["bitwise"]


def test_a_fingerprint_that_sees_nothing_misses_them(isolated):
    """Negative control: the same scenario with a constant fingerprint leaves tensors out."""
    out = isolated.run(run_layout_changes, constant=True)
    missed = [name for name, (ok, _) in out["seen"].items() if not ok]
    assert "the other half's first step" in missed and "load_state_dict" in missed
    assert "param group added" in missed and "masters replaced" in missed


class CountingDict(dict):
    """A parameter's state dict that counts how often its size or contents are asked for."""

    touches = 0

    def __len__(self):
        CountingDict.touches += 1
        return super().__len__()

    def __iter__(self):
        CountingDict.touches += 1
        return super().__iter__()

    def keys(self):
        CountingDict.touches += 1
        return super().keys()

    def values(self):
        CountingDict.touches += 1
        return super().values()

    def items(self):
        CountingDict.touches += 1
        return super().items()


def _touches_per_call(n_params: int, fingerprint_of) -> tuple[int, int]:
    """(per-parameter state dicts touched by 10 calls of a steady fingerprint, of them the
    ones of the parameter that never had a gradient)."""
    owner = Owner(sizes=[3] * n_params, state_dict_type=CountingDict)
    owner.step(0, which=set(range(1, n_params)))  # parameter 0 gets no gradient: no state
    fingerprint = fingerprint_of(owner)
    first = fingerprint()
    CountingDict.touches = 0
    values = [fingerprint() for _ in range(10)]
    assert all(v == first for v in values)
    return CountingDict.touches


def _old_fingerprint(owner):
    """The offloader's fingerprint before the state watch: every parameter's entry count."""

    def fingerprint():
        state = owner.optimizer.state
        return len(state), sum(map(len, dict.values(state)))

    return fingerprint


def test_a_steady_fingerprint_touches_no_state_dict_whatever_the_parameter_count():
    small, large = _touches_per_call(40, StateWatch), _touches_per_call(800, StateWatch)
    assert small == large == 0, (small, large)


def test_the_count_based_fingerprint_touched_every_state_dict():
    """Negative control for the test above: the fingerprint it replaces is O(parameters)."""
    small, large = _touches_per_call(40, _old_fingerprint), _touches_per_call(800, _old_fingerprint)
    assert (small, large) == (10 * 39, 10 * 799)


def test_a_parameter_without_state_stays_watched_and_its_states_are_seen():
    owner = Owner(sizes=[3] * 5)
    owner.step(0, which={1, 2, 3, 4})
    watch = StateWatch(owner)
    first = watch()
    assert watch() == first
    owner.step(1)  # parameter 0's first gradient: its states appear, nothing else changes
    assert watch() != first


def test_master_grads_are_dropped_only_when_a_master_holds_one():
    owner = Owner(sizes=[3] * 6)
    masters = owner.shard_fp32_from_float16_groups[0]
    watch = StateWatch(owner)
    assert watch.release_master_grads() is False  # nothing to free: nothing visited
    for subset in (range(6), range(3), [5]):  # all (megatron's loop), a prefix, the last
        for i in subset:
            masters[i].grad = torch.ones(3)
        assert watch.release_master_grads() is True
        assert all(m.grad is None for m in masters)
    owner.shard_fp32_from_float16_groups[0] = [m.clone() for m in masters]  # a new layout
    owner.shard_fp32_from_float16_groups[0][0].grad = torch.ones(3)
    assert watch.release_master_grads() is True
    assert all(m.grad is None for m in owner.shard_fp32_from_float16_groups[0])
