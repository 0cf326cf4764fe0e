"""The Transformer Engine FusedAdam double reproduces the TE 2.17 behaviours it documents.

Each test names the behaviour (numbered as in ``tests/harness/doubles/te_fused_adam.py``). These run in
the test process: nothing here releases memory.
"""

import pytest
import torch

from tests.harness.doubles import apex_fused_adam
from tests.harness.doubles.te_fused_adam import (
    DType,
    Float8Quantizer,
    Float8Tensor,
    FusedAdam,
    te_line,
)

N = 37  # not a multiple of anything, so nothing lines up by accident


def _params(dtype=torch.bfloat16, count=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter((torch.randn(N + i, generator=gen) * 0.1).to(dtype))
        for i in range(count)
    ]


def _grads(params, seed=1, decoupled=True):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        g = torch.randn(p.shape, generator=gen) * 0.01
        if decoupled:
            p.decoupled_grad = g  # fp32 grads of bf16 params, as megatron-core passes them
        else:
            p.grad = g.to(p.dtype)


def _stepped_once(moments):
    """Parameters and a FusedAdam storing remainders, after one step with gradients."""
    params = _params()
    opt = _te(params, True, moments)
    _grads(params)
    opt.step()
    return params, opt


def _te(params, remainders=True, moments=torch.float32, master=torch.float32, **kw):
    return FusedAdam(
        params,
        lr=1e-2,
        weight_decay=0.1,
        master_weights=True,
        master_weight_dtype=master,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
        use_decoupled_grad=True,
        store_param_remainders=remainders,
        **kw,
    )


# ----------------------------------------------------------------- 1. constructor
def test_1_constructor_checks_and_maps():
    p = _params()
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="fp32/fp16 master"):
        FusedAdam(p, master_weights=True, master_weight_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="exp_avg"):
        FusedAdam(p, exp_avg_dtype=torch.float64)
    with pytest.raises(RuntimeError, match="both torch.float32 or both torch.bfloat16"):
        FusedAdam(p, capturable=True, exp_avg_dtype=torch.bfloat16)  # 2.13+: bf16 needs both
    with (
        te_line("2.12"),
        pytest.raises(RuntimeError, match="Capturable mode only supports fp32 exp_avg"),
    ):
        FusedAdam(p, capturable=True, exp_avg_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="remainders"):
        FusedAdam(p, capturable=True, store_param_remainders=True)
    opt = _te(p, moments=torch.uint8)
    assert opt.name_to_dtype_map == {
        "exp_avg": torch.uint8,
        "exp_avg_sq": torch.uint8,
        "master_param": torch.float32,
    }
    assert opt.dtype_to_range_map[torch.uint8].item() == 448.0
    assert opt.dtype_to_range_map[torch.float16].item() == torch.finfo(torch.float16).max / 2
    assert opt._scales == {}
    # store_param_remainders needs master weights in fp32
    assert _te(p).store_param_remainders
    assert not _te(p, master=torch.float16).store_param_remainders
    assert not FusedAdam(p, store_param_remainders=True).store_param_remainders


def test_1_signature_has_what_megatron_checks():
    import inspect

    names = inspect.signature(FusedAdam).parameters
    for name in (
        "master_weight_dtype",
        "exp_avg_dtype",
        "exp_avg_sq_dtype",
        "use_decoupled_grad",
        "store_param_remainders",
        "master_weights",
        "adam_w_mode",
        "capturable",
    ):
        assert name in names


# ------------------------------------------------------------ 2./3. state layout
@pytest.mark.parametrize("remainders", [True, False])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_2_3_4_state_layout_after_the_first_step(remainders, moments):
    params = _params()
    opt = _te(params, remainders, moments)
    _grads(params[:1])  # only the first param has a gradient
    opt.step()
    assert opt.param_groups[0]["step"] == 1 and isinstance(opt.param_groups[0]["step"], int)
    for p in params:  # state for every parameter, gradient or not
        state = opt.state[p]
        assert set(state) == {"exp_avg", "exp_avg_sq", "master_param"}
        for name in ("exp_avg", "exp_avg_sq"):
            value = state[name]
            assert value.shape == p.shape
            if moments == torch.uint8:
                assert type(value) is Float8Tensor and value.dtype == torch.float32
                assert value._data.dtype == torch.uint8 and value._data.shape == p.shape
                assert value._transpose.dtype == torch.uint8
                assert value._transpose.numel() == p.numel()
                assert value._scale_inv.shape == (1,) and value._quantizer.scale.shape == (1,)
            else:
                assert type(value) is torch.Tensor and value.dtype == moments
        master = state["master_param"]
        assert master.dtype == (torch.int16 if remainders else torch.float32)
        scales = opt._scales.get(p, {})
        expected = {"exp_avg", "exp_avg_sq"} if moments != torch.float32 else set()
        assert set(scales) == expected
        assert all(s.shape == (1,) and s.dtype == torch.float32 for s in scales.values())
    # The parameter without a gradient kept its initial state.
    untouched = opt.state[params[1]]
    assert opt.get_unscaled_state(params[1], "exp_avg").abs().max() == 0
    if remainders:
        assert torch.equal(untouched["master_param"], torch.zeros_like(untouched["master_param"]))
    else:
        assert torch.equal(untouched["master_param"], params[1].float())


def test_2_group_step_counts_steps_even_without_gradients():
    params = _params()
    opt = _te(params)
    for _ in range(3):
        opt.step()  # no gradients at all
    assert opt.param_groups[0]["step"] == 3
    assert all(len(opt.state[p]) == 3 for p in params)


def test_3_initialize_state_needs_both_arguments_and_set_scaled_state_creates():
    params = _params()
    opt = _te(params, remainders=True, moments=torch.bfloat16)
    with pytest.raises(TypeError):
        opt.initialize_state(params[0])  # TE has no default for store_param_remainders
    opt.initialize_state(params[0], True)
    assert opt.state[params[0]]["master_param"].dtype == torch.int16
    opt.set_scaled_state(params[1], "exp_avg", torch.ones(params[1].shape))
    assert set(opt.state[params[1]]) == {"exp_avg"}
    assert opt.state[params[1]]["exp_avg"].dtype == torch.bfloat16


# ------------------------------------------------------- 5. get/set unscaled state
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
def test_5_get_unscaled_state_is_live_only_for_fp32_and_int16(moments):
    params, opt = _stepped_once(moments)
    p = params[0]
    master = opt.get_unscaled_state(p, "master_param")
    assert master is opt.state[p]["master_param"] and master.dtype == torch.int16
    moment = opt.get_unscaled_state(p, "exp_avg")
    assert moment.dtype == torch.float32
    assert (moment is opt.state[p]["exp_avg"]) == (moments == torch.float32)


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float16, torch.uint8])
def test_5_set_scaled_state_writes_in_place_and_updates_scales_in_place(moments):
    params, opt = _stepped_once(moments)
    p = params[0]
    state = opt.state[p]["exp_avg"]
    storage = (state._data if isinstance(state, Float8Tensor) else state).data_ptr()
    scale = opt._scales[p]["exp_avg"]
    value = torch.linspace(-3, 5, p.numel())
    opt.set_scaled_state(p, "exp_avg", value.clone())
    assert opt.state[p]["exp_avg"] is state and opt._scales[p]["exp_avg"] is scale
    assert (state._data if isinstance(state, Float8Tensor) else state).data_ptr() == storage
    back = opt.get_unscaled_state(p, "exp_avg")
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.uint8: 0.4}[moments]
    assert torch.allclose(back, value, atol=tolerance, rtol=0.07)
    if moments != torch.bfloat16:  # bf16 keeps its scale of ones
        assert scale.item() == pytest.approx(5.0 / opt.dtype_to_range_map[moments].item())
    with pytest.raises(AssertionError):
        opt.set_scaled_state(p, "exp_avg", value.double())
    with pytest.raises(AssertionError):
        opt.set_scaled_state(p, "master_param", value)  # remainders take int16 only


def test_5_fp16_set_scaled_state_scales_the_callers_tensor_like_te():
    params = _params()
    opt = _te(params, True, torch.float16)
    opt.initialize_state(params[0], True)
    value = torch.full(params[0].shape, 2.0)
    opt.set_scaled_state(params[0], "exp_avg", value)
    assert not torch.equal(value, torch.full(params[0].shape, 2.0))  # mutated in place by TE


# --------------------------------------------------------------- 6. state dicts
@pytest.mark.parametrize("remainders", [True, False])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16, torch.uint8])
def test_6_state_dict_is_unscaled_and_load_state_dict_makes_new_tensors(remainders, moments):
    params = _params()
    opt = _te(params, remainders, moments)
    for step in range(3):
        _grads(params, seed=step)
        opt.step()
    sd = opt.state_dict()
    p = params[0]
    entry = sd["state"][0]
    assert set(entry) == {"exp_avg", "exp_avg_sq", "master_param"}
    assert entry["master_param"] is opt.state[p]["master_param"]  # live fp32/int16
    assert entry["master_param"].dtype == (torch.int16 if remainders else torch.float32)
    assert entry["exp_avg"].dtype == torch.float32
    assert (entry["exp_avg"] is opt.state[p]["exp_avg"]) == (moments == torch.float32)
    assert sd["param_groups"][0]["step"] == 3

    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()}
    old = {n: opt.state[p][n] for n in opt.state[p]}
    old_scales = dict(opt._scales.get(p, {}))
    opt.load_state_dict({"state": saved, "param_groups": sd["param_groups"]})
    for name, tensor in opt.state[p].items():
        assert tensor is not old[name]  # every state rebuilt
    for name, scale in opt._scales.get(p, {}).items():
        assert scale is not old_scales[name]
    again = opt.state_dict()
    for k, v in saved.items():
        for name, t in v.items():
            assert torch.equal(again["state"][k][name], t), (k, name)


def test_6_load_state_dict_uses_the_given_tensors_not_torchs_cast_copies():
    # torch's own load casts state to the param dtype (bf16); TE rebuilds from the given dict,
    # so int16 remainders and fp32 values survive.
    params, opt = _stepped_once(torch.float32)
    sd = opt.state_dict()
    saved = {k: {n: t.clone() for n, t in v.items()} for k, v in sd["state"].items()}
    fresh = _te(_params(), True, torch.float32)
    fresh.load_state_dict({"state": saved, "param_groups": sd["param_groups"]})
    for k, v in saved.items():
        param = fresh.param_groups[0]["params"][k]
        for name, t in v.items():
            assert torch.equal(fresh.state[param][name], t)


# ----------------------------------------------------------------------- 7. step
def test_7_remainders_are_lossless_fp32_masters():
    """Remainder mode must train exactly like an fp32 master in the optimizer state."""
    runs = []
    for remainders in (True, False):
        params = _params()
        opt = _te(params, remainders)
        for step in range(5):
            _grads(params, seed=step)
            opt.step()
        runs.append((params, opt))
    (pa, oa), (pb, ob) = runs
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(oa.state[a][name], ob.state[b][name])
        # bf16 high bits (minus one for a negative remainder) + int16 low bits == fp32 master
        high = a.detach().view(torch.int16).to(torch.int32)
        low = oa.state[a]["master_param"].to(torch.int32)
        high = torch.where(low < 0, high - 1, high)
        joined = ((high << 16) | (low & 0xFFFF)).view(torch.float32)
        assert torch.equal(joined, ob.state[b]["master_param"])
        # and the param is the master rounded to nearest
        assert torch.equal(a.detach(), ob.state[b]["master_param"].bfloat16())


def test_7_update_formula_matches_an_fp64_adamw_reference():
    params = _params(torch.float32, count=1)
    ref = params[0].detach().double().clone()
    opt = FusedAdam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    m = torch.zeros_like(ref)
    v = torch.zeros_like(ref)
    for step in range(1, 4):
        _grads(params, seed=step, decoupled=False)
        g = params[0].grad.double()
        opt.step()
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        update = (m / (1 - 0.9**step)) / ((v / (1 - 0.99**step)).sqrt() + 1e-8) + 0.1 * ref
        ref = ref - 1e-2 * update
    assert torch.allclose(params[0].double(), ref, rtol=1e-5, atol=1e-7)


def test_7_fp32_params_keep_an_unused_master_param():
    params = _params(torch.float32)
    opt = _te(params, True)
    initial = [p.detach().clone() for p in params]
    for step in range(2):
        _grads(params, seed=step)
        opt.step()
    for p, p0 in zip(params, initial):
        assert opt.state[p]["master_param"].dtype == torch.float32  # no remainders for fp32
        assert torch.equal(opt.state[p]["master_param"], p0)  # never updated
        assert not torch.equal(p.detach(), p0)


def test_7_states_are_updated_in_place():
    params, opt = _stepped_once(torch.uint8)
    p = params[0]
    before = {
        n: (t, (t._data if isinstance(t, Float8Tensor) else t).data_ptr())
        for n, t in opt.state[p].items()
    }
    _grads(params, seed=7)
    opt.step()
    for name, (tensor, ptr) in before.items():
        assert opt.state[p][name] is tensor
        assert (tensor._data if isinstance(tensor, Float8Tensor) else tensor).data_ptr() == ptr


def test_7_mixed_fp16_bf16_params_raise():
    params = _params(torch.bfloat16, 1) + _params(torch.float16, 1)
    opt = FusedAdam(params, master_weights=True, use_decoupled_grad=True)
    _grads(params)
    with pytest.raises(RuntimeError, match="mix of float16 and bfloat16"):
        opt.step()


# ------------------------------------------------------------------- 8. zero_grad
def test_8_zero_grad_drops_decoupled_grads():
    params = _params()
    opt = _te(params)
    _grads(params)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in params)


# --------------------------------------------------------------- 9. Float8Tensor
def _fp8(values):
    quantizer = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3)
    tensor = quantizer.make_empty(values.shape)
    tensor.quantize_(values)
    return tensor


def test_9_float8_tensor_layout_and_dequantize():
    values = torch.linspace(-2, 3, N)
    t = _fp8(values)
    assert t.dtype == torch.float32 and t.shape == values.shape and t.numel() == N
    assert type(t) is Float8Tensor and isinstance(t, torch.Tensor)
    assert t._data.dtype == torch.uint8 and not t._transpose_invalid
    assert torch.equal(t._transpose, t._data)  # the transpose of a 1-D tensor: same bytes
    assert t._scale_inv.item() == 1.0
    expected = values.to(torch.float8_e4m3fn).float()
    assert torch.equal(t.float(), expected) and torch.equal(t.dequantize(), expected)
    assert type(t.float()) is torch.Tensor
    assert float(t._quantizer.amax) == 3.0


def test_9_copy_from_plain_quantizes_in_place_with_the_quantizer_scale():
    t = _fp8(torch.zeros(N))
    ptr = t._data.data_ptr()
    t._quantizer.scale.fill_(4.0)
    t.copy_(torch.full((N,), 0.5))
    assert t._data.data_ptr() == ptr
    assert t._scale_inv.item() == 0.25
    assert torch.equal(t.float(), torch.full((N,), 0.5))
    assert torch.equal(t._data.view(torch.float8_e4m3fn).float(), torch.full((N,), 2.0))


def test_9_quantization_saturates():
    t = _fp8(torch.tensor([1000.0, -1000.0, 1.0]))
    assert t.float().tolist() == [448.0, -448.0, 1.0]


def test_9_other_ops_dequantize_and_in_place_ops_requantize():
    t = _fp8(torch.linspace(-1, 1, N))
    plain = t + 1
    assert type(plain) is torch.Tensor and torch.equal(plain, t.float() + 1)
    ptr = t._data.data_ptr()
    t.mul_(2)
    assert type(t) is Float8Tensor and t._data.data_ptr() == ptr
    assert torch.allclose(t.float(), (torch.linspace(-1, 1, N) * 2), atol=0.07)
    clone = t.clone()
    assert type(clone) is Float8Tensor and clone._data.data_ptr() != t._data.data_ptr()
    assert torch.equal(clone.float(), t.float())
    assert torch.equal(t.detach().to("cpu"), t.float())  # .to() dequantizes


def test_9_fp8_moment_rescaling_uses_absmax_over_448():
    params, opt = _stepped_once(torch.uint8)
    p = params[0]
    state = opt.state[p]["exp_avg"]
    scale = opt._scales[p]["exp_avg"]
    unscaled = state.float()
    assert torch.allclose(scale * 448, unscaled.abs().max(), rtol=0.07)
    assert torch.equal(state._quantizer.scale, 1 / scale)


# -------------------------------------------------------------------- apex double
def test_apex_double_has_state_only_for_params_with_gradients():
    params = _params(torch.float32, 3)
    opt = apex_fused_adam.FusedAdam(params, lr=1e-2)
    _grads(params[:2], decoupled=False)
    opt.step()
    assert set(opt.state) == set(params[:2])
    assert opt.param_groups[0]["step"] == 1
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert all(set(s) == {"exp_avg", "exp_avg_sq"} for s in opt.state.values())
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_3_9_created_fp8_states_start_from_uninitialized_memory_like_te():
    """set_scaled_state on a missing FP8 state quantizes ``torch.empty_like`` first: the
    value is then overwritten, the quantizer's amax keeps the garbage's maximum."""
    params = _params()
    opt = _te(params, True, torch.uint8)
    value = torch.full(params[0].shape, 0.25)
    opt.set_scaled_state(params[0], "exp_avg", value.clone())
    state = opt.state[params[0]]["exp_avg"]
    assert torch.allclose(state.float(), value, rtol=0.07)
    assert state._quantizer.amax.item() >= 0.25
