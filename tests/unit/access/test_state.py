"""The state access (access/state.py) and the update gate (offloader/gate.py), in one process,
against stand-in optimizers and engines: which policy each optimizer gets, what a read of the
state mapping, a state method, torch's own hooks and a Megatron-FSDP module's state dict do
in each phase, and what every update passes. No megatron-core, no rank process: the behaviour
of the real ones is the integration tier's (tests/integration/access)."""

from __future__ import annotations

import collections
import pickle
import time
import types

import pytest
import torch

from megatron_offload.access.state import GuardedState, Policy, StateAccess
from megatron_offload.errors import OffloadStateError
from megatron_offload.interceptions import Interceptions
from megatron_offload.offloader.gate import UpdateGate
from megatron_offload.phase import Phase, PhaseTracker


class _Engine:
    """What the state access and the gate ask of an engine; records what they did."""

    def __init__(self, released: bool = True) -> None:
        self.released = released
        self.calls: list[str] = []
        self.pieces = ()  # nothing to serve from a host copy (host views are the integration's)

    def is_released(self, kinds=None) -> bool:
        return self.released

    def reload(self, kinds=None, *, streamed: bool = True) -> None:
        self.calls.append("reload" if streamed else "reload(whole)")
        self.released = False

    def wait(self, kinds=None) -> None:
        self.calls.append("wait")

    def synchronize_host(self, kinds=None) -> None:
        self.calls.append("synchronize_host")

    def mark_dirty(self, kinds=None, *, on_device: bool = False) -> None:
        self.calls.append("mark_dirty")

    def invalidate(self) -> None:
        self.calls.append("invalidate")

    def stats(self) -> dict:
        return {"resident_bytes": 0}

    def check_disk(self) -> None:  # no disk tier here
        pass

    def settle_disk(self) -> None:
        pass


class _Wrapper:
    """A Megatron optimizer stand-in: one inner torch AdamW and one state method."""

    def __init__(self, **attributes) -> None:
        param = torch.nn.Parameter(torch.ones(4))
        param.grad = torch.ones(4)
        self.optimizer = torch.optim.AdamW([param], lr=0.1)
        self.optimizer.step()  # states exist
        self.seen: list[Phase] = []
        self.__dict__.update(attributes)

    def state_dict(self):
        self.seen.append(self.phase.current)
        return {"optimizer": self.optimizer.state_dict()}


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))


def _access(*wrappers, released=True):
    phase = PhaseTracker()
    members = []
    for wrapper in wrappers:
        wrapper.phase = phase
        members.append(types.SimpleNamespace(optimizer=wrapper, engine=_Engine(released)))
    installed = Interceptions()
    access = StateAccess(wrappers[0], members, phase, installed)
    return access, members, phase, installed


def _fsdp_wrapper():
    ddp_config = types.SimpleNamespace(use_megatron_fsdp=True, nccl_ub=False)
    chunk = types.SimpleNamespace(module=_Module())
    return _Wrapper(ddp_config=ddp_config, model_chunks=[chunk])


def test_each_optimizer_gets_its_policy_once_and_the_listing_names_it():
    access, _, _, installed = _access(_Wrapper())
    assert access.policies == (Policy.HOST_COPY,)
    whys = {why for _, where, why in installed.listing() if where == "_Wrapper.state_dict"}
    assert whys == {"a checkpoint method: served from the host copy"}
    access, _, _, installed = _access(_fsdp_wrapper())
    assert access.policies == (Policy.HOST_VIEW,)
    whys = {why for _, where, why in installed.listing() if where == "_Wrapper.state_dict"}
    assert whys == {
        "a checkpoint method: served from the host copy inside a host view (megatron.training's "
        "synchronous save opens one), else the states come back to the device until the next "
        "offload"
    }


def test_a_read_between_steps_brings_its_optimizers_states_back_once():
    first, second = _Wrapper(), _Wrapper()
    access, members, phase, _ = _access(first, second)
    state = first.optimizer.state
    assert type(state) is GuardedState
    param = first.optimizer.param_groups[0]["params"][0]
    assert len(state) == 1 and param in state  # touch no tensor: nothing comes back
    assert members[0].engine.calls == []
    exp_avg = state[param]["exp_avg"]
    assert torch.equal(exp_avg, first.optimizer.state[param]["exp_avg"])
    assert members[0].engine.calls == ["reload", "wait", "mark_dirty"]
    assert members[1].engine.calls == []  # the other optimizer's states stay on the host
    state[param]["exp_avg"]  # on the device now: nothing more to do
    assert members[0].engine.calls == ["reload", "wait", "mark_dirty"]
    members[0].engine.released = True  # the next offload
    state.setdefault(param, {})  # a write may put new tensors in
    assert members[0].engine.calls[-4:] == ["reload", "wait", "mark_dirty", "invalidate"]


@pytest.mark.parametrize("current", [Phase.STEPPING, Phase.MOVING, Phase.STREAMING, Phase.SERVING])
def test_outside_idle_the_mapping_is_read_where_it_is(current):
    wrapper = _Wrapper()
    access, members, phase, _ = _access(wrapper)
    with phase.within(current):
        list(wrapper.optimizer.state.values())
    assert members[0].engine.calls == []


def test_a_state_method_is_served_from_the_host_copy_or_brings_the_states_back():
    served = _Wrapper()
    access, members, phase, _ = _access(served)
    served.state_dict()
    assert served.seen == [Phase.SERVING]  # inside a host view, nothing brought back
    assert "reload" not in members[0].engine.calls
    assert phase.current is Phase.IDLE and access.figures.calls == 1
    brought = _fsdp_wrapper()
    access, members, phase, _ = _access(brought)
    brought.state_dict()
    assert brought.seen == [Phase.IDLE]  # no host view: the states came back first
    # A save: the host copy stays valid, until torch's state_dict() hands out the live tensors.
    assert members[0].engine.calls == ["reload", "wait", "wait", "mark_dirty", "invalidate"]
    assert access.figures.calls == 0


def test_host_views_nest_and_a_step_inside_one_is_refused_before_anything_moves():
    wrapper = _Wrapper()
    access, members, phase, installed = _access(wrapper)
    sleep = types.SimpleNamespace(asleep=False, gradients_dropped=False)
    gate = UpdateGate(phase, members, sleep, installed)
    with access.host_view(writes=False) as outer:
        with access.host_view(writes=True) as inner:
            assert inner is outer and phase.current is Phase.SERVING
        with pytest.raises(OffloadStateError, match="inside host_view"):
            wrapper.optimizer.step()
    assert members[0].engine.calls == ["wait", "synchronize_host", "mark_dirty"]  # noted write
    assert phase.current is Phase.IDLE
    gate.remove()


def test_every_update_passes_the_gate_which_wakes_brings_back_and_orders():
    wrapper = _Wrapper()
    access, members, phase, installed = _access(wrapper)
    woken = []
    sleep = types.SimpleNamespace(asleep=True, gradients_dropped=False)
    sleep.wake = lambda: (woken.append(1), setattr(sleep, "asleep", False))
    gate = UpdateGate(phase, members, sleep, installed)
    wrapper.optimizer.step()  # a step on the inner optimizer directly, no cycle
    assert woken == [1] and members[0].engine.calls == ["reload", "wait", "mark_dirty"]
    gate.chunked = ["a chunked update"]
    with phase.within(Phase.STEPPING):
        wrapper.optimizer.step()  # what it streams stays on the host
    assert members[0].engine.calls[-3:] == ["reload(whole)", "wait", "mark_dirty"]
    gate.remove()
    assert not wrapper.optimizer._optimizer_step_pre_hooks


def test_torch_hooks_bring_the_states_back_outside_a_host_view_and_guard_a_loaded_mapping():
    wrapper = _Wrapper()
    access, members, phase, _ = _access(wrapper)
    saved = wrapper.optimizer.state_dict()
    assert members[0].engine.calls == ["reload", "wait", "mark_dirty", "invalidate"]
    wrapper.optimizer.load_state_dict(saved)  # torch puts a new defaultdict in
    state = wrapper.optimizer.state
    assert type(state) is GuardedState and state.access is access


def test_a_megatron_fsdp_models_state_dict_brings_its_masters_back_between_steps():
    wrapper = _fsdp_wrapper()
    access, members, phase, _ = _access(wrapper)
    module = wrapper.model_chunks[0].module
    with phase.within(Phase.STEPPING):
        module.state_dict()
    assert members[0].engine.calls == []
    module.state_dict()
    assert members[0].engine.calls == ["reload", "wait"]  # a read: the host copy stays valid
    saved = module.state_dict()
    members[0].engine.released = True
    module.load_state_dict(saved)
    assert members[0].engine.calls[-3:] == ["reload", "wait", "mark_dirty"]
    module.load_state_dict(saved)  # on the device already: the load still makes them changed
    assert members[0].engine.calls[-2:] == ["wait", "mark_dirty"]


def test_a_replaced_mapping_is_guarded_again_and_remove_gives_a_plain_one_back():
    wrapper = _Wrapper()
    access, members, phase, installed = _access(wrapper)
    inner = wrapper.optimizer
    entries = dict(dict.items(inner.state))
    inner.state = collections.defaultdict(dict, entries)  # the wrapper's ``state`` setter
    access.guard_replaced()
    assert type(inner.state) is GuardedState and dict(dict.items(inner.state)) == entries
    kept = inner.state
    access.remove()
    installed.remove_all()
    assert type(inner.state) is collections.defaultdict and inner.state == entries
    assert kept.access is None and installed.listing() == []
    kept.get(next(iter(entries)))  # a reference kept elsewhere: plain, nothing reached
    assert members[0].engine.calls == []


def test_the_guarded_mapping_prints_copies_and_pickles_as_a_defaultdict():
    state = GuardedState(dict)
    state["a"]["x"] = 1
    assert repr(state) == repr(collections.defaultdict(dict, {"a": {"x": 1}}))
    copied = state.copy()
    assert type(copied) is collections.defaultdict and copied == {"a": {"x": 1}}
    restored = pickle.loads(pickle.dumps(state))
    assert type(restored) is collections.defaultdict and restored == {"a": {"x": 1}}
    merged = state | {"b": 2}
    assert type(merged) is collections.defaultdict and merged == {"a": {"x": 1}, "b": 2}
    merged = {"b": 2} | state
    assert type(merged) is collections.defaultdict and merged["a"] == {"x": 1}
    assert state.__or__(1) is NotImplemented and state.__ror__(1) is NotImplemented


# ------------------------------------------------------------------ the cost in the step
def measure_guard_cost(count=300, numel=64, steps=60):
    """The fastest step of torch AdamW with its plain defaultdict and with the mapping attach
    installs, in the phase every step sees it (``STEPPING``), alternating step by step so that
    both see the same machine load. The minimum, not the median: on a shared machine another
    process only ever adds time, and a median of 40 steps moved by 27% under a second test
    lane while the minimum is what the code itself costs."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen)
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    optimizer.step()  # states exist from here on
    plain = optimizer.state
    guarded = GuardedState(plain.default_factory)
    dict.update(guarded, plain)
    phase = PhaseTracker()
    guarded.phase = phase
    phase.enter(Phase.STEPPING)
    times = {"plain": [], "guarded": []}
    for index in range(steps):
        order = (("plain", plain), ("guarded", guarded))
        for name, mapping in order if index % 2 else order[::-1]:
            optimizer.state = mapping
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()} | {"lookups": count}


@pytest.mark.perf
def test_the_guard_adds_little_to_a_step_and_never_switches_the_class(isolated):
    """The mapping's accessors check one attribute chain before the plain dict method runs:
    one Python call per state lookup of the step. Bounded here against the plain defaultdict
    on an AdamW step whose per-parameter Python work is small (300 tensors of 64 elements)."""
    from pathlib import Path

    import megatron_offload

    package = Path(megatron_offload.__file__).parent
    assigning = [
        str(p.relative_to(package)) for p in package.rglob("*.py") if "__class__ =" in p.read_text()
    ]
    assert assigning == []  # no class is assigned at run time anywhere in the package
    figures = isolated.run(measure_guard_cost)
    per_lookup = (figures["guarded"] - figures["plain"]) / figures["lookups"]
    print(
        f"\nAdamW step, 300 params x 64: plain {figures['plain'] * 1e3:.3f} ms, "
        f"guarded {figures['guarded'] * 1e3:.3f} ms ({per_lookup * 1e9:.0f} ns per parameter)"
    )
    assert figures["guarded"] <= 1.25 * figures["plain"]  # generous: a shared 2-core machine
