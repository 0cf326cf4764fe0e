"""``collect()`` on each inner optimizer's state layout, and the engine moving what it yields.

The DistributedOptimizer is stood in for by the two attributes ``collect`` reads
(``optimizer`` and ``shard_fp32_from_float16_groups``); the megatron-core runs are in
``test_te_precision_aware.py`` and ``test_apex.py``. Cycles that release memory run in the
isolated process (touching released memory would crash pytest).
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_offload.adapters import (
    MASTER_WEIGHTS,
    OPTIMIZER_STATES,
    collect,
    inner_optimizers,
    kind_of,
    state_access,
)
from tests.harness.doubles import apex_fused_adam
from tests.harness.doubles.te_fused_adam import Float8Tensor, FusedAdam

N = 29


def _shards(dtype=torch.bfloat16, count=3):
    gen = torch.Generator().manual_seed(3)
    return [
        torch.nn.Parameter((torch.randn(N + 5 * i, generator=gen) * 0.1).to(dtype))
        for i in range(count)
    ]


def _decoupled(params, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.decoupled_grad = torch.randn(p.shape, generator=gen) * 0.01


def _te_optimizer(
    remainders=True,
    exp_avg=torch.float32,
    exp_avg_sq=None,
    master=torch.float32,
    dtype=torch.bfloat16,
):
    params = _shards(dtype)
    opt = FusedAdam(
        params,
        lr=1e-2,
        master_weights=True,
        master_weight_dtype=master,
        exp_avg_dtype=exp_avg,
        exp_avg_sq_dtype=exp_avg_sq or exp_avg,
        use_decoupled_grad=True,
        store_param_remainders=remainders,
    )
    _decoupled(params)
    opt.step()
    # precision-aware: megatron-core keeps no masters outside the optimizer (a list of Nones)
    dist = SimpleNamespace(optimizer=opt, shard_fp32_from_float16_groups=[[None] * len(params)])
    return dist, opt, params


def _expected(opt, params):
    """What must move, derived from TE's documented layout (not from the adapter)."""
    out = []
    for p in params:
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            kind = MASTER_WEIGHTS if key == "master_param" else OPTIMIZER_STATES
            if isinstance(value, Float8Tensor):
                out += [(kind, value._data), (kind, value._transpose)]
            else:
                out.append((kind, value))
    return out


@pytest.mark.parametrize("remainders", [True, False])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_te_state_is_collected_buffer_by_buffer(remainders, moments):
    dist, opt, params = _te_optimizer(remainders, moments)
    got = list(collect(dist))
    want = _expected(opt, params)
    assert [k for k, _ in got] == [k for k, _ in want]
    assert all(a is b for (_, a), (_, b) in zip(got, want))  # the very tensor objects
    assert all(type(t) is torch.Tensor for _, t in got)  # never an FP8 wrapper
    masters = [t for k, t in got if k == MASTER_WEIGHTS]
    assert {t.dtype for t in masters} == {torch.int16 if remainders else torch.float32}
    states = {t.dtype for k, t in got if k == OPTIMIZER_STATES}
    assert states == {moments}
    # TE's [1] tensors (scales, FP8 scale-inverses, quantizer scale/amax) stay put
    small = {id(s) for d in opt._scales.values() for s in d.values()}
    for p in params:
        for value in opt.state[p].values():
            if isinstance(value, Float8Tensor):
                small |= {
                    id(value._scale_inv),
                    id(value._quantizer.scale),
                    id(value._quantizer.amax),
                }
    assert not small & {id(t) for _, t in got}
    # stable: an unchanged state yields the same tensors in the same order
    again = list(collect(dist))
    assert all(a is b and k == j for (k, a), (j, b) in zip(got, again))


def test_mixed_moment_dtypes_and_fp16_masters():
    dist, opt, params = _te_optimizer(True, torch.bfloat16, torch.uint8, master=torch.float16)
    got = list(collect(dist))
    assert {(k, t.dtype) for k, t in got} == {
        (OPTIMIZER_STATES, torch.bfloat16),
        (OPTIMIZER_STATES, torch.uint8),
        (MASTER_WEIGHTS, torch.float16),
    }


def test_fp8_state_without_transpose_moves_its_data_only():
    dist, opt, params = _te_optimizer(True, torch.uint8)
    for p in params:
        opt.state[p]["exp_avg"].remove_caches()
    got = list(collect(dist))
    per_param = 1 + 2 + 1  # exp_avg _data, exp_avg_sq _data + _transpose, master_param
    assert len(got) == per_param * len(params)


def test_unknown_tensor_subclasses_are_handed_over_unchanged():
    class Opaque(torch.Tensor):
        pass

    dist, opt, params = _te_optimizer(True, torch.float32)
    strange = opt.state[params[0]]["exp_avg"].as_subclass(Opaque)
    opt.state[params[0]]["exp_avg"] = strange
    assert any(t is strange for _, t in collect(dist))  # the engine keeps it resident, visibly


def test_apex_state_appears_with_gradients():
    params = _shards(torch.float32)
    opt = apex_fused_adam.FusedAdam(params, lr=1e-2)
    dist = SimpleNamespace(optimizer=opt, shard_fp32_from_float16_groups=None)
    assert list(collect(dist)) == []
    params[1].grad = torch.ones_like(params[1])
    opt.step()
    got = list(collect(dist))
    assert [(k, t) for k, t in got] == [
        (OPTIMIZER_STATES, opt.state[params[1]]["exp_avg"]),
        (OPTIMIZER_STATES, opt.state[params[1]]["exp_avg_sq"]),
    ]


def test_torch_adamw_state_and_external_masters():
    shards = _shards(torch.float32)
    opt = torch.optim.AdamW(shards, lr=1e-2)
    for p in shards:
        p.grad = torch.ones_like(p)
    opt.step()
    masters = [shards[0]]  # stands for shard_fp32_from_float16_groups
    dist = SimpleNamespace(optimizer=opt, shard_fp32_from_float16_groups=[masters])
    got = list(collect(dist))
    assert got[0] == (MASTER_WEIGHTS, shards[0])
    assert len(got) == 1 + 2 * len(shards)  # never the scalar step
    assert all(t.numel() > 1 for _, t in got)


def test_kind_and_state_access():
    dist, te, _ = _te_optimizer()
    apex = apex_fused_adam.FusedAdam(_shards(torch.float32))
    adamw = torch.optim.AdamW(_shards(torch.float32))
    assert kind_of(te) == inner_optimizers.TE_FUSED_ADAM
    assert kind_of(apex) == inner_optimizers.APEX_FUSED_ADAM
    assert kind_of(adamw) == inner_optimizers.TORCH_ADAM
    access = state_access(te)
    assert {"state_dict", "get_unscaled_state"} <= set(access.reads)
    assert "set_scaled_state" in access.writes and "load_state_dict" in access.replaces
    for name in access.reads + access.writes + access.replaces:
        assert callable(getattr(te, name))
    assert state_access(adamw).reads == ("state_dict",)


# ------------------------------------------------- the engine on TE state (isolated process)
def _engine_cycle(moments_name, remainders, cycles):
    """Offload/release/reload TE state through the engine; return what must be unchanged."""
    import torch

    from megatron_offload.device import device_for
    from megatron_offload.engine import OffloadEngine
    from tests.unit.adapters import test_collect as me

    moments = {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8": torch.uint8,
    }[moments_name]
    dist, opt, params = me._te_optimizer(remainders, moments)
    engine = OffloadEngine(device_for(torch.device("cpu")), lambda: collect(dist))
    wrappers = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items()}
    expected_sd = {
        k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()
    }
    figures = []
    for cycle in range(cycles):
        engine.offload()
        engine.release()
        st = engine.stats()
        figures.append(
            {
                "offloaded": st["offloaded_bytes"],
                "tracked": st["tracked_bytes"],
                "kept": st["kept_resident_bytes"],
                "max_storage": max(t.untyped_storage().nbytes() for _, t in collect(dist)),
            }
        )
        engine.reload()
        engine.wait()
    same_objects = all(opt.state[params[i]][k] is v for (i, k), v in wrappers.items())
    sd = opt.state_dict()["state"]
    equal = all(torch.equal(sd[k][n], t) for k, v in expected_sd.items() for n, t in v.items())
    # and training goes on from the reloaded state
    _decoupled(params, seed=5)
    opt.step()
    groups = len(engine.pieces)
    engine.close()
    return {"figures": figures, "same_objects": same_objects, "equal": equal, "groups": groups}


@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("remainders", [True, False])
def test_engine_round_trips_te_state(isolated, moments, remainders):
    out = isolated.run(_engine_cycle, moments, remainders, 3)
    assert out["same_objects"] and out["equal"] and out["groups"] == 2
    for fig in out["figures"]:
        assert fig["offloaded"] == fig["tracked"] > 0
        assert fig["kept"] == 0 and fig["max_storage"] == 0
