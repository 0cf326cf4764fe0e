"""Reading the states through the inner optimizer's ``state`` mapping while they are offloaded.

Research code reads states between steps (``optimizer.optimizer.state[p]["exp_avg"].sum()``);
without the guard that touches released memory and kills the process. Every access form
runs here in rank processes (a regression kills the rank and fails the test with its exit
code), on and off, and training after the reads must be bitwise identical. A read that meets
released states brings that optimizer's states and masters back (the reader gets the live
tensors); they stay until the next offload (docs/design.md: reads between steps).
"""

import pytest
import torch

# Reads that touch no tensor (tensors hash by identity): they leave the states offloaded.
TOUCH_NO_TENSOR = ("len", "in")


def _reads(optimizer, distrib, param):
    """(name, read) for every way code reaches the states through the mapping."""
    import copy

    inner = distrib.optimizer

    def total(values):
        return sum(float(v) for v in values)

    def reduced(reduce_value):
        cls, args, _, _, items = reduce_value
        return cls.__name__, args, total(v["exp_avg"].sum() for _, v in items)

    reads = [
        ("index", lambda: float(inner.state[param]["exp_avg"].sum())),
        ("get", lambda: float(inner.state.get(param)["exp_avg_sq"].sum())),
        ("values", lambda: total(v["exp_avg"].sum() for v in inner.state.values())),
        # Keys are the parameter shards: the offloaded fp32 masters of a bf16 model.
        ("items", lambda: total(k.sum() + v["exp_avg_sq"].sum() for k, v in inner.state.items())),
        ("keys", lambda: total(k.sum() for k in inner.state.keys())),
        ("iteration", lambda: total(k.sum() for k in inner.state)),
        ("dict", lambda: total(v["exp_avg"].sum() for v in dict(inner.state).values())),
        ("repr", lambda: repr(inner.state)),
        # What pickle and copy.deepcopy call (deepcopy itself refuses the non-leaf keys of fp32).
        ("reduce", lambda: reduced(inner.state.__reduce__())),
        ("copy", lambda: total(v["exp_avg"].sum() for v in inner.state.copy().values())),
        ("copy.copy", lambda: total(v["exp_avg"].sum() for v in copy.copy(inner.state).values())),
        ("setdefault", lambda: float(inner.state.setdefault(param, {})["exp_avg"].sum())),
        # megatron-core's own views of the same mapping.
        ("megatron_state", lambda: float(distrib.state[param]["exp_avg"].sum())),
        ("len", lambda: len(inner.state)),
        ("in", lambda: (param in inner.state, torch.zeros(1) in inner.state)),
    ]
    if hasattr(optimizer, "chained_optimizers"):  # ChainedOptimizer.state: a ProxyDict
        reads.append(("chained_proxy", lambda: float(optimizer.state[(0, param)]["exp_avg"].sum())))
    return reads


def reads_job(offload, dtype, checked=False, options=None):
    import megatron_offload
    from megatron_offload.access.state import GuardedState, StateAccess
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    chunks, optimizer, config = models.build("mlp", dtype)
    distrib = models.distributed_optimizers(optimizer)[0]
    inner = distrib.optimizer
    options, devices = checked_device_options(options) if checked else (dict(options or {}), [])
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    bring_backs = []
    if offloader:
        # Count every time the state access brings states back (this rank process only).
        bring_back = StateAccess.bring_back

        def counting(self, *args, **kwargs):
            bring_backs.append(kwargs)
            return bring_back(self, *args, **kwargs)

        StateAccess.bring_back = counting
    results = [models.train_step(chunks, optimizer, config, step) for step in range(2)]
    chunks_per_step = [offloader.stats()["update_chunks"]] if offloader else []
    param = inner.param_groups[0]["params"][0]
    values, seen, on_device = {}, {}, {}
    tracked = (
        {
            kind: [
                t for e in offloader.engines for g in e.pieces if g.kind == kind for t in g.tensors
            ]
            for kind in ("optimizer_states", "master_weights")
        }
        if offloader
        else {}
    )
    for name, read in _reads(optimizer, distrib, param):
        if offloader and not offloader.is_offloaded:
            offloader.offload()  # every read starts from offloaded states
        before = offloader.is_offloaded if offloader else None
        values[name] = read()
        seen[name] = (before, offloader.is_offloaded if offloader else None)
        # What the read brought to the device: the bytes of the tracked tensors' own storages.
        on_device[name] = {
            kind: sum(t.untyped_storage().nbytes() for t in tensors)
            for kind, tensors in tracked.items()
        }
        if offloader:
            offloader.offload()  # ends the read (the next step would)
    raw = {}
    if offloader:
        # The offloader's own walks read the mapping raw: they bring nothing back.
        offloader.offload()
        count = len(bring_backs)
        offloader.mark_optimizer_states_initialized()
        offloader.offload()  # walks every state again
        offloader.stats()
        raw = {
            "bring_backs": len(bring_backs) - count,
            "offloaded": offloader.is_offloaded,
            "guarded": inner.state.access is offloader.access,
            "type": type(inner.state).__name__,
        }
    # The research-code pattern: a read after every step; each next step offloads again.
    pattern = []
    for step in range(2, 5):
        results.append(models.train_step(chunks, optimizer, config, step))
        after_step = offloader.is_offloaded if offloader else None
        if offloader:
            chunks_per_step.append(offloader.stats()["update_chunks"])
        value = float(inner.state[param]["exp_avg"].sum()) + float(
            inner.state[param]["exp_avg_sq"].sum()
        )
        pattern.append(
            (
                after_step,
                value,
                offloader.is_offloaded if offloader else None,
                type(inner.state).__name__,
            )
        )
    plain_type = type(inner.state)
    if offloader:
        offloader.detach()
        StateAccess.bring_back = bring_back
    check_devices(devices)
    return {
        "results": results,
        "values": values,
        "seen": seen,
        "on_device": on_device,
        "raw": raw,
        "pattern": pattern,
        "plain_is_guarded_state": plain_type is GuardedState,
        "chunks_per_step": chunks_per_step,
        "after_detach": type(inner.state).__name__,
        "snapshot": models.snapshot(chunks, optimizer),
    }


@pytest.mark.parametrize(
    "dtype,checked,options",
    [
        ("bf16", True, None),
        pytest.param("fp32", False, None, marks=pytest.mark.floor),
        ("bf16", True, {"chunked_update_bytes": 1 << 17}),
    ],
    ids=["bf16-checked", "fp32", "bf16-chunked-checked"],
)
def test_reads_through_the_state_mapping_are_safe_and_training_stays_bitwise(
    rank_pool, dtype, checked, options
):
    reference = rank_pool.run(reads_job, False, dtype)
    guarded = rank_pool.run(reads_job, True, dtype, checked, options)
    for ref, off in zip(reference, guarded):
        assert off["results"] == ref["results"]
        # Every read sees exactly the values the run without offloading sees.
        assert off["values"] == ref["values"]
        assert off["values"]["reduce"][0] == "defaultdict"  # pickles and copies are plain mappings
        for key, value in ref["snapshot"]["params"].items():
            assert torch.equal(value, off["snapshot"]["params"][key]), key
        for key, value in ref["snapshot"]["optimizer"].items():
            assert torch.equal(value, off["snapshot"]["optimizer"][key]), key
        assert set(off["seen"]) >= set(TOUCH_NO_TENSOR) | {
            "index",
            "get",
            "values",
            "items",
            "keys",
        }
        masters = dtype != "fp32"  # an fp32 model's parameters are the keys: never offloaded
        for name, (before, after) in off["seen"].items():
            assert before, name  # the read met released states...
            brought = off["on_device"][name]
            if name in TOUCH_NO_TENSOR:  # ...and left them there
                assert after and brought == {"optimizer_states": 0, "master_weights": 0}, name
                continue
            # ...and brought them back, masters too (the keys of a bf16 model's mapping).
            assert not after and brought["optimizer_states"] > 0, name
            assert (brought["master_weights"] > 0) == masters, (name, brought)
        assert off["raw"] == {
            "bring_backs": 0,
            "offloaded": True,
            "guarded": True,
            "type": "GuardedState",
        }
        for after_step, value, after_read, state_type in off["pattern"]:
            # Offloaded after each step; the read brought them back until the next one.
            assert after_step and not after_read and state_type == "GuardedState"
        assert [v for _, v, _, _ in off["pattern"]] == [v for _, v, _, _ in ref["pattern"]]
        assert off["plain_is_guarded_state"] and off["after_detach"] == "defaultdict"
        if options:
            # The step reads the mapping while the chunked update streams: no reload then.
            assert off["chunks_per_step"][0] >= 2
