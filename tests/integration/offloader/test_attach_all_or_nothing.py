"""``attach`` is all or nothing: a failure at any of its steps leaves the optimizer exactly as
it was, and a second ``attach`` with corrected options works.

Every call ``attach`` makes that changes something (an arena reserved, the optimizer
marked, a method wrapped, a state mapping replaced, a hook registered, a chunked update
built, states offloaded, the step wrapped, a warning hook installed) is counted during one
successful attach; then, for each k, the k-th of those calls raises (right after it ran, or
in its place where its result is what would undo it: a hook's handle, a wrapper). After
each failure the optimizer's attributes, its inner optimizer's attributes, hook tables and
state tensors must be what they were (the same objects, the same bytes). After all of them,
an attach works and training is bitwise that of a run that never attached. Whole mode,
chunked update and backward-pass prefetch each add steps of their own.
"""

import functools

import pytest
import torch


class InjectedFault(RuntimeError):
    pass


def _primitives():
    """(owner, attribute name) of every call through which attach changes something."""
    import importlib

    from megatron_offload.access.state import StateAccess
    from megatron_offload.chunked.update import ChunkedUpdate
    from megatron_offload.engine import OffloadEngine
    from megatron_offload.interceptions import Interceptions
    from megatron_offload.offloader import allocator_warnings
    from megatron_offload.offloader.offloader import OptimizerStateOffloader

    # (``megatron_offload.offloader.cycle`` the attribute is the function, not the module.)
    attach_module = importlib.import_module("megatron_offload.offloader.cycle")
    return [
        (attach_module, "_refuse_chain_member"),
        (attach_module, "_refuse_backward_prefetch_under_cuda_graphs"),
        (OffloadEngine, "reserve_host"),
        (Interceptions, "replace"),
        (StateAccess, "_install"),
        (Interceptions, "wrap"),
        (torch.optim.Optimizer, "register_state_dict_pre_hook"),
        (torch.optim.Optimizer, "register_load_state_dict_pre_hook"),
        (torch.optim.Optimizer, "register_load_state_dict_post_hook"),
        (torch.optim.Optimizer, "register_step_pre_hook"),
        (ChunkedUpdate, "install"),
        (OptimizerStateOffloader, "offload"),
        (attach_module, "_backward_prefetch_hook"),
        (attach_module, "prefetch_at_gradient_reduction"),
        (functools, "update_wrapper"),  # the step wrapper (and the guard's, counted in _wrap too)
        (allocator_warnings, "warn_where_frees_wait"),
    ]


class _Injector:
    """Wraps the primitives; the ``fail_at``-th call (counting from 1) raises after running."""

    def __init__(self):
        self.calls = []
        self.fail_at = None
        self._saved = []

    def __enter__(self):
        for owner, name in _primitives():
            original = getattr(owner, name)  # a class's own method or one it inherits
            self._saved.append((owner, name, vars(owner).get(name)))
            setattr(
                owner, name, self._counting(original, f"{getattr(owner, '__name__', owner)}.{name}")
            )
        return self

    def _counting(self, original, label):
        injector = self
        # A call whose result is what undoes it (a hook's handle, a wrapper about to be put
        # in place) fails instead of running; any other fails right after it ran.
        before = label.endswith(("_hook", "update_wrapper"))

        def call(*args, **kwargs):
            injector.calls.append(label)
            index = len(injector.calls)
            if injector.fail_at == index and before:
                raise InjectedFault(f"injected at call {index}: {label}")
            result = original(*args, **kwargs)
            if injector.fail_at == index:
                raise InjectedFault(f"injected at call {index}: {label}")
            return result

        return call

    def __exit__(self, *exc):
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _shape(obj) -> dict:
    """The attributes of ``obj``: each value's identity, and the length of tables."""
    return {
        key: (id(value), len(value) if isinstance(value, (dict, list)) else None)
        for key, value in vars(obj).items()
    }


def _picture(optimizer):
    from tests.harness import models

    wrappers = models.distributed_optimizers(optimizer)
    inners = [w.optimizer for w in wrappers]
    tensors = []
    for inner in inners:
        for group in inner.param_groups:
            for param in group["params"]:
                tensors.append(param)
                for value in dict.get(inner.state, param, {}).values():
                    if isinstance(value, torch.Tensor):
                        tensors.append(value)
    configs = {
        id(chunk.config): chunk.config for w in wrappers for chunk in getattr(w, "model_chunks", [])
    }
    return {
        # The loop's finalize_model_grads_func (prefetch="gradients" wraps it).
        "finalize": sorted(id(c.finalize_model_grads_func) for c in configs.values()),
        "objects": [_shape(o) for o in [optimizer, *wrappers, *inners]],
        "state_types": [type(inner.state) for inner in inners],
        "tensors": [(id(t), t.untyped_storage().nbytes(), t.detach().clone()) for t in tensors],
    }


def _differences(before, after) -> list[str]:
    found = []
    if before["objects"] != after["objects"]:
        for index, (b, a) in enumerate(zip(before["objects"], after["objects"])):
            changed = sorted(k for k in set(b) | set(a) if b.get(k) != a.get(k))
            if changed:
                found.append(f"object {index}: {changed}")
    if before["finalize"] != after["finalize"]:
        found.append("the model config's finalize_model_grads_func")
    if before["state_types"] != after["state_types"]:
        found.append(f"state mapping types {after['state_types']}")
    for (bid, bbytes, bvalue), (aid, abytes, avalue) in zip(before["tensors"], after["tensors"]):
        if bid != aid or bbytes != abytes or not torch.equal(bvalue, avalue):
            found.append("a tensor was replaced, released or changed")
            break
    return found


OPTIONS = {
    "whole": {},
    "chunked": {"chunked_update_bytes": 1 << 18},
    "prefetch": {"prefetch": 0.5},
}


def all_or_nothing_job(mode):
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    models.train_step(chunks, optimizer, config, 0)  # states exist: the arena is sized in full
    options = OPTIONS[mode]
    found = {}

    # A budget too small: refused at attach, not at the next step; a second attach works.
    before = _picture(optimizer)
    try:
        megatron_offload.attach(optimizer, host_memory_budget=100, **options)
    except megatron_offload.HostMemoryBudgetError as error:
        found["budget"] = str(error)
    found["budget_untouched"] = _differences(before, _picture(optimizer))

    with _Injector() as injector:
        megatron_offload.attach(optimizer, **options).detach()
        found["steps"] = list(injector.calls)
        before = _picture(optimizer)
        found["failures"] = []
        for k in range(1, len(found["steps"]) + 1):
            injector.calls, injector.fail_at = [], k
            try:
                megatron_offload.attach(optimizer, **options)
                outcome = "attached"
            except InjectedFault as fault:
                outcome = str(fault)
            found["failures"].append((k, outcome, _differences(before, _picture(optimizer))))
        injector.fail_at = None

    offloader = megatron_offload.attach(optimizer, **options)
    found["losses"] = [
        models.train_step(chunks, optimizer, config, step)["loss"] for step in (1, 2)
    ]
    found["offloaded"] = offloader.is_offloaded
    offloader.detach()
    found["snapshot"] = models.snapshot(chunks, optimizer)
    return found


def reference_job():
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    losses = [models.train_step(chunks, optimizer, config, step)["loss"] for step in (0, 1, 2)]
    return {"losses": losses[1:], "snapshot": models.snapshot(chunks, optimizer)}


@pytest.mark.parametrize("mode", sorted(OPTIONS))
def test_a_failure_at_any_step_of_attach_leaves_the_optimizer_as_it_was(rank_pool, mode):
    found = rank_pool.run(all_or_nothing_job, mode)[0]
    reference = rank_pool.run(reference_job)[0]
    assert (
        "host_memory_budget=100" in found["budget"] and "Nothing was allocated" in found["budget"]
    )
    assert found["budget_untouched"] == []
    steps = found["steps"]
    # The steps that change something were all reached (so every one was made to fail).
    for needed in (
        "reserve_host",
        "replace",
        "_install",
        "Interceptions.wrap",
        "register_step_pre_hook",
        "update_wrapper",
        "warn_where_frees_wait",
    ):
        assert any(step.endswith(needed) for step in steps), (needed, steps)
    if mode == "chunked":
        assert any(step.endswith("ChunkedUpdate.install") for step in steps)
        assert any(step.endswith(".offload") for step in steps)  # states made before attach
    if mode == "prefetch":
        assert any(step.endswith("_backward_prefetch_hook") for step in steps)
    else:  # prefetch="gradients", the default: the loop's finalize_model_grads_func is wrapped
        assert any(step.endswith("prefetch_at_gradient_reduction") for step in steps)
    assert len(found["failures"]) == len(steps)
    for k, outcome, differences in found["failures"]:
        assert outcome.startswith(f"injected at call {k}:"), (k, outcome)
        assert differences == [], (k, outcome, differences)
    assert found["offloaded"]
    assert found["losses"] == reference["losses"]
    for section in ("params", "optimizer"):
        assert found["snapshot"][section].keys() == reference["snapshot"][section].keys()
        for key, value in reference["snapshot"][section].items():
            assert torch.equal(value, found["snapshot"][section][key]), (section, key)


def chain_member_job():
    import warnings

    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    member = optimizer.chained_optimizers[0]
    found = {}
    try:
        megatron_offload.attach(member)
    except ValueError as error:
        found["member"] = str(error)
    found["member_untouched"] = "_state_offloader" not in vars(member) and "step" not in vars(
        member
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloader = megatron_offload.attach(
            optimizer, offload_optimizer_states=False, offload_master_weights=False
        )
        found["nothing_warnings"] = [str(w.message) for w in caught]
        offloader.detach()
        caught.clear()
        offloader = megatron_offload.attach(optimizer)
        found["default_warnings"] = [str(w.message) for w in caught]
    found["summary_before"] = offloader.summary()
    models.train_step(chunks, optimizer, config, 0)
    found["chain_offloads"] = offloader.is_offloaded
    found["summary"], found["str"], found["stats"] = (
        offloader.summary(),
        str(offloader),
        offloader.stats(),
    )
    offloader.detach()
    return found


def test_attaching_to_a_chain_member_is_refused_and_an_empty_selection_warns(rank_pool):
    found = rank_pool.run(chain_member_job)[0]
    message = found["member"]
    assert "chained_optimizers[0]" in message and "Attach to the ChainedOptimizer" in message
    assert found["member_untouched"]
    assert (
        len(found["nothing_warnings"]) == 1
        and "nothing will be offloaded" in found["nothing_warnings"][0]
    )
    assert found["default_warnings"] == []
    assert found["chain_offloads"]
    from megatron_offload.report import human_bytes

    stats = found["stats"]
    assert found["summary"].startswith(f"offloaded {human_bytes(stats['offloaded_bytes'])} | host ")
    assert "last D2H" in found["summary"] and found["summary"].endswith("| 1 cycle")
    # The masters exist from the optimizer's construction: attach sent them out already.
    assert "last D2H" in found["summary_before"] and found["summary_before"].endswith("| 0 cycles")
    assert found["str"] == "OptimizerStateOffloader (1 optimizer(s)): " + found["summary"]
