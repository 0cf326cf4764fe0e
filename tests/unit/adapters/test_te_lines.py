"""The TE FusedAdam double's release lines, its temporaries, FP8 transposes and zero moments.

``te_line`` selects what differs between Transformer Engine lines (read from the sources):
2.8-2.12 unscale every non-fp32 state into an fp32 temporary; 2.13-2.18 update two bf16
moments in place (``fuse_unscale``) and accept ``get_unscaled_state(..., skip_unscale=...)``;
2.19+ advance ``group["step"]`` for empty groups too. The offloader sizes its budget from the
same facts (``inner_optimizers.planned_state_bytes`` and ``transient_bytes``): checked here
against what the double really allocates. In-process: nothing here releases memory.
"""

import pytest
import torch

from megatron_offload.adapters import inner_optimizers
from tests.harness.doubles import te_fused_adam
from tests.harness.doubles.te_fused_adam import LINES, Float8Tensor, FusedAdam, te_line

SIZES = (36, 40, 12)  # multiples of 4 elements: fp32 temporaries need no alignment padding
MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}


def _build(
    line,
    moments,
    remainders=True,
    master=torch.float32,
    empty_group=False,
    param_dtype=torch.bfloat16,
):
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter((torch.randn(n, generator=gen) * 0.1).to(param_dtype)) for n in SIZES
    ]
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    if empty_group:
        groups.append({"params": []})
    with te_line(line):
        opt = FusedAdam(
            groups,
            lr=1e-2,
            weight_decay=0.1,
            master_weights=True,
            master_weight_dtype=master,
            exp_avg_dtype=MOMENTS[moments],
            exp_avg_sq_dtype=MOMENTS[moments],
            use_decoupled_grad=True,
            store_param_remainders=remainders,
        )
    return params, opt


def _grads(params, seed, zero=False):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.decoupled_grad = (
            torch.zeros(p.shape) if zero else torch.randn(p.shape, generator=gen) * 0.01
        )


def _bytes(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _state_bytes(opt, params):
    out = []
    for p in params:
        out.append(_bytes(p))
        for key in sorted(opt.state[p]):
            value = opt.state[p][key]
            out.extend(
                [_bytes(value._data), _bytes(value._transpose)]
                if isinstance(value, Float8Tensor)
                else [_bytes(value)]
            )
    return out


def test_line_of_maps_versions_to_lines():
    assert [
        te_fused_adam.line_of(v)
        for v in ("2.8.0", "2.12", "2.13.0", "2.17.1", "2.18", "2.19.0", "3.0")
    ] == ["2.12", "2.12", "2.17", "2.17", "2.17", "2.19", "2.19"]
    with pytest.raises(ValueError, match="unknown TE line"):
        with te_line("2.14"):
            pass


@pytest.mark.parametrize("line", LINES)
def test_fuse_unscale_and_skip_unscale_by_line(line):
    params, opt = _build(line, "bf16")
    _grads(params, 1)
    opt.step()
    p = params[0]
    if line == "2.12":
        assert not hasattr(opt, "fuse_unscale")
        with pytest.raises(TypeError, match="skip_unscale"):
            opt.get_unscaled_state(p, "exp_avg", skip_unscale=True)
    else:
        assert opt.fuse_unscale is True
        assert opt.get_unscaled_state(p, "exp_avg", skip_unscale=True) is opt.state[p]["exp_avg"]
    unscaled = opt.get_unscaled_state(p, "exp_avg")
    assert unscaled.dtype == torch.float32 and unscaled is not opt.state[p]["exp_avg"]
    # Only both moments bf16 fuse.
    _, mixed = _build(line, "fp32")
    assert getattr(mixed, "fuse_unscale", False) is False


@pytest.mark.parametrize("moments", ["bf16", "fp8", "fp16", "fp32"])
def test_every_line_computes_the_same_bytes(moments):
    results = []
    for line in LINES:
        params, opt = _build(line, moments)
        for step in range(3):
            _grads(params, step)
            opt.step()
        results.append(_state_bytes(opt, params))
    for other in results[1:]:
        assert len(other) == len(results[0])
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@pytest.mark.parametrize("line", LINES)
def test_empty_groups_count_steps_from_2_19(line):
    params, opt = _build(line, "fp32", empty_group=True)
    for step in range(3):
        _grads(params, step)
        opt.step()
    assert [g.get("step") for g in opt.param_groups] == [3, 3, 3 if line == "2.19" else None]


@pytest.mark.parametrize("line", LINES)
@pytest.mark.parametrize(
    "moments,remainders,master",
    [
        ("fp8", True, torch.float32),
        ("fp8", False, torch.float32),
        ("bf16", True, torch.float32),
        ("fp16", False, torch.float16),
        ("fp32", True, torch.float32),
        ("bf16", False, torch.float16),
    ],
)
def test_the_planner_knows_states_and_temporaries_before_they_exist(
    line, moments, remainders, master
):
    params, opt = _build(line, moments, remainders, master)
    planned = [
        inner_optimizers.planned_state_bytes(opt, p, moments=True, masters=True) for p in params
    ]
    transient = sum(inner_optimizers.transient_bytes(opt, p) for p in params)
    _grads(params, 0)
    opt.step()
    for p, (nbytes, exact) in zip(params, planned):
        actual = sum(
            -(-t.numel() * t.element_size() // 16) * 16
            for _, t in inner_optimizers.state_tensors(p, opt.state[p])
        )
        assert exact and nbytes == actual, (nbytes, actual)
    # The double's accounting of its fp32 temporaries (what TE allocates per step call).
    assert opt.transient_bytes_last_call == transient
    fused = moments == "bf16" and line != "2.12" and master == torch.float32
    expected_per_element = {"fp8": 8, "fp16": 8, "fp32": 0, "bf16": 0 if line != "2.12" else 8}[
        moments
    ]
    expected_per_element += 4 if master == torch.float16 else 0
    assert transient == expected_per_element * sum(SIZES), (transient, fused)


def test_an_all_zero_fp8_moment_holds_nan_so_comparisons_compare_bytes():
    """TE's behaviour: absmax 0 gives a scale of 0, and quantizing with 1/0 stores NaN."""
    params, opt = _build("2.17", "fp8")
    _grads(params, 0, zero=True)
    opt.step()
    state = opt.state[params[0]]["exp_avg"]
    values = state.float()
    assert torch.isnan(values).all()
    assert opt._scales[params[0]]["exp_avg"].item() == 0.0
    assert not torch.equal(values, values)  # a value comparison calls the run different
    assert torch.equal(_bytes(state._data), _bytes(state._data.clone()))  # bytes do not


def test_te_reads_the_fp8_transpose_outside_step():
    """Why the offloader copies ``_transpose`` (tests/harness/doubles follow TE 2.17's float8_tensor):
    FusedAdam never reads it, but ``clone()`` copies it and a Float8Tensor-to-Float8Tensor
    ``copy_`` reads the source's, so a transpose left stale after a reload would spread."""
    params, opt = _build("2.17", "fp8")
    _grads(params, 0)
    opt.step()
    state = opt.state[params[0]]["exp_avg"]
    state._transpose.fill_(0x55)  # stands for a transpose regrown without its bytes
    assert torch.equal(state.clone()._transpose, state._transpose)
    target = state.clone()
    target._transpose.zero_()
    target.copy_(state)
    assert (target._transpose == 0x55).all()
    # What FusedAdam reads (dequantize: the data only) does not see it.
    assert torch.equal(
        opt.get_unscaled_state(params[0], "exp_avg"),
        state._data.view(torch.float8_e4m3fn).float() * state._scale_inv,
    )
