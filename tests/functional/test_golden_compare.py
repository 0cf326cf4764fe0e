"""The golden-value comparison itself (``golden_values.compare`` and ``check``), on made-up
trajectories: no torchrun, no training, runs in well under a second.

Rule under test: exact on the platform the golden file was written on; on any other platform
lm loss and grad norm within ``RTOL``, everything else but the checkpoint digests exactly.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from tests.functional import golden_values, runner

HERE = {
    "vendor": "GenuineIntel",
    "model": "Intel(R) Xeon(R) Platinum 8488C",
    "capability": "AVX512",
    "torch": "2.13.0+cu130",
    "megatron-core": "0.19.2",
}
ELSEWHERE = dict(HERE, vendor="AuthenticAMD", model="AMD EPYC 9R14")


def _hex(value: float) -> str:
    return float(value).hex()


def _golden(platform=HERE) -> dict:
    return {
        "case": "made-up",
        "platform": dict(platform),
        "iterations": [
            {"iteration": 1, "lm_loss": _hex(4.852362155914307), "grad_norm": None, "skipped": 1},
            {
                "iteration": 2,
                "lm_loss": _hex(4.859340667724609),
                "grad_norm": _hex(1.3263347148895264),
                "skipped": 0,
            },
            {
                "iteration": 3,
                "lm_loss": _hex(4.759474277496338),
                "grad_norm": _hex(1.1967512369155884),
                "skipped": 0,
            },
        ],
        "optimizer_state_bytes_per_rank": [662016, 662016],
        "saves_per_rank": [
            [{"iteration": 3, "state_sha256": "a" * 64}],
            [{"iteration": 3, "state_sha256": "b" * 64}],
        ],
    }


def _actual(golden: dict) -> dict:
    return copy.deepcopy({key: golden[key] for key in golden_values.SECTIONS})


def _scale(actual: dict, iteration: int, key: str, factor: float) -> dict:
    entry = actual["iterations"][iteration - 1]
    entry[key] = _hex(float.fromhex(entry[key]) * factor)
    return actual


# ------------------------------------------------------------------------------ same platform
def test_same_platform_identical_run_matches_exactly():
    golden = _golden()
    result = golden_values.compare(_actual(golden), golden, dict(HERE))
    assert result.exact and result.ok and result.digests_left_out is None


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_same_platform_one_ulp_fails(key):
    golden = _golden()
    actual = _actual(golden)
    entry = actual["iterations"][2]
    entry[key] = _hex(math.nextafter(float.fromhex(entry[key]), math.inf))
    result = golden_values.compare(actual, golden, dict(HERE))
    assert result.exact and not result.ok
    assert len(result.mismatches) == 1 and f"iteration 3: {key}" in result.mismatches[0]


def test_same_platform_digest_difference_fails():
    golden = _golden()
    actual = _actual(golden)
    actual["saves_per_rank"][1][0]["state_sha256"] = "c" * 64
    result = golden_values.compare(actual, golden, dict(HERE))
    assert not result.ok and "state digest" in result.mismatches[0]
    assert result.digests_left_out is None


# ------------------------------------------------------------------------------ other platform
@pytest.mark.parametrize(
    "other",
    [
        ELSEWHERE,
        dict(HERE, capability="AVX2"),
        dict(HERE, torch="2.14.0+cu130"),
        dict(HERE, **{"megatron-core": "0.20.0"}),
    ],
    ids=["cpu-model", "isa", "torch", "megatron-core"],
)
def test_any_platform_field_makes_it_another_platform(other):
    golden = _golden()
    actual = _scale(_actual(golden), 3, "grad_norm", 1 + 3e-5)
    assert not golden_values.compare(actual, golden, dict(HERE)).ok  # exact here
    result = golden_values.compare(actual, golden, dict(other))
    assert not result.exact and result.ok


def test_other_platform_cross_cpu_drift_passes_and_digests_are_left_out():
    golden = _golden()
    actual = _actual(golden)
    for iteration in (2, 3):  # the drift seen between two CPU models after a few iterations
        _scale(actual, iteration, "lm_loss", 1 - 3e-5)
        _scale(actual, iteration, "grad_norm", 1 + 3e-5)
    for rank in actual["saves_per_rank"]:
        rank[0]["state_sha256"] = "d" * 64
    result = golden_values.compare(actual, golden, dict(ELSEWHERE))
    assert not result.exact
    assert result.ok, result.mismatches
    reason = result.digests_left_out
    assert reason is not None and "digests not compared" in reason
    # The reason names both platforms.
    assert "GenuineIntel" in reason and "AuthenticAMD" in reason and "AMD EPYC 9R14" in reason


@pytest.mark.parametrize("key", ["lm_loss", "grad_norm"])
def test_other_platform_one_percent_fails(key):
    golden = _golden()
    actual = _scale(_actual(golden), 2, key, 1 + 1e-2)
    result = golden_values.compare(actual, golden, dict(ELSEWHERE))
    assert not result.ok
    assert len(result.mismatches) == 1 and f"iteration 2: {key}" in result.mismatches[0]
    assert "rtol" in result.mismatches[0]


def test_other_platform_tolerance_edge():
    golden = _golden()
    rtol = golden_values.RTOL
    inside = _scale(_actual(golden), 3, "grad_norm", 1 + 0.9 * rtol)
    outside = _scale(_actual(golden), 3, "grad_norm", 1 + 1.1 * rtol)
    assert golden_values.compare(inside, golden, dict(ELSEWHERE)).ok
    assert not golden_values.compare(outside, golden, dict(ELSEWHERE)).ok


def test_other_platform_changed_skipped_flag_fails():
    golden = _golden()
    actual = _actual(golden)
    actual["iterations"][0]["skipped"] = 0
    actual["iterations"][0]["grad_norm"] = _hex(1.25)  # a step that ran reports a grad norm
    result = golden_values.compare(actual, golden, dict(ELSEWHERE))
    assert not result.ok
    assert any("iteration 1: skipped 0, golden 1" in line for line in result.mismatches)


def test_other_platform_exact_parts_still_exact():
    golden = _golden()
    fewer = _actual(golden)
    fewer["iterations"].pop()
    state_bytes = _actual(golden)
    state_bytes["optimizer_state_bytes_per_rank"][0] += 4
    save_iteration = _actual(golden)
    save_iteration["saves_per_rank"][0][0]["iteration"] = 2
    nan_loss = _actual(golden)
    nan_loss["iterations"][1]["lm_loss"] = _hex(math.nan)
    for actual, says in (
        (fewer, "2 iterations, golden has 3"),
        (state_bytes, "optimizer-state bytes"),
        (save_iteration, "checkpoint save iterations"),
        (nan_loss, "iteration 2: lm_loss"),
    ):
        result = golden_values.compare(actual, golden, dict(ELSEWHERE))
        assert not result.ok and says in "\n".join(result.mismatches), (says, result)


def test_sections_limit_what_is_compared():
    golden = _golden()
    actual = _actual(golden)
    actual["optimizer_state_bytes_per_rank"] = [0, 0]
    actual["saves_per_rank"][0][0]["state_sha256"] = "e" * 64
    assert golden_values.compare(actual, golden, dict(HERE), sections=("iterations",)).ok
    assert not golden_values.compare(actual, golden, dict(HERE)).ok
    with pytest.raises(ValueError):
        golden_values.compare(actual, golden, dict(HERE), sections=("digests",))


def test_no_saves_means_nothing_left_out():
    golden = _golden()
    golden["saves_per_rank"] = [[], []]
    result = golden_values.compare(_actual(golden), golden, dict(ELSEWHERE))
    assert result.ok and result.digests_left_out is None


# ------------------------------------------------------------------------------ check()
def test_check_reports_left_out_digests(monkeypatch, capsys):
    golden = _golden()
    monkeypatch.setattr(golden_values, "read", lambda case, device: copy.deepcopy(golden))
    monkeypatch.setattr(golden_values, "platform", lambda device: dict(ELSEWHERE))
    actual = _scale(_actual(golden), 3, "grad_norm", 1 + 3e-5)
    with pytest.warns(UserWarning, match="checkpoint digests not compared"):
        result = golden_values.check(actual, "made-up", "cpu")
    assert result.ok and not result.exact
    assert "checkpoint digests not compared" in capsys.readouterr().out

    monkeypatch.setattr(golden_values, "platform", lambda device: dict(HERE))
    with pytest.raises(AssertionError, match="exact comparison"):
        golden_values.check(actual, "made-up", "cpu")


def test_check_missing_file(monkeypatch):
    monkeypatch.setattr(golden_values, "read", lambda case, device: None)
    assert golden_values.check({}, "made-up", "cpu", required=False) is None
    with pytest.raises(pytest.fail.Exception, match="no golden values"):
        golden_values.check({}, "made-up", "cpu")


# ------------------------------------------------------------------------------ platform
def test_cpu_identity_reads_proc_cpuinfo():
    text = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core\n\n"
        "processor\t: 1\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core\n"
    )
    assert golden_values.cpu_identity(text) == ("AuthenticAMD", "AMD EPYC 9R14 96-Core")


def test_cpu_identity_falls_back_to_platform_processor(monkeypatch):
    monkeypatch.setattr(golden_values.pyplatform, "processor", lambda: "arm-fallback")
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n"  # names neither
    assert golden_values.cpu_identity(arm) == ("arm-fallback", "arm-fallback")
    assert golden_values.cpu_identity("") == ("arm-fallback", "arm-fallback")


def test_golden_files_one_per_case_with_their_platform():
    names = sorted(path.name for path in golden_values.GOLDEN_DIR.glob("*.json"))
    cpu_files = [f"{case}.cpu.json" for case in sorted(runner.CASES)]
    assert set(cpu_files) <= set(names), names
    # Nothing but <case>.<device>[.mcore-<line>].json: no per-platform file names.
    allowed = {
        golden_values.golden_path(case, device, line).name
        for case in runner.CASES
        for device in ("cpu", "cuda")
        for line in (golden_values.MAIN_LINE, "0.17", "0.18")
    }
    assert set(names) <= allowed, sorted(set(names) - allowed)
    for name in names:
        data = json.loads((golden_values.GOLDEN_DIR / name).read_text())
        case, device = name.split(".")[:2]
        assert data["case"] == case and data["device"] == device
        # The file's line is the one its platform names.
        line = golden_values.megatron_line(data["platform"]["megatron-core"])
        assert golden_values.golden_path(case, device, line).name == name, name
        assert sorted(data["platform"]) == sorted(golden_values.PLATFORM_KEYS), name
        assert all(isinstance(v, str) and v for v in data["platform"].values()), name


@pytest.mark.parametrize(
    "version, line, name",
    [
        ("0.19.2", "0.19", "dp2.cpu.json"),
        ("0.19.0rc1", "0.19", "dp2.cpu.json"),
        ("0.18.2", "0.18", "dp2.cpu.mcore-0.18.json"),
        ("0.17.1", "0.17", "dp2.cpu.mcore-0.17.json"),
        ("0.20.0.dev0", "0.20", "dp2.cpu.mcore-0.20.json"),
    ],
)
def test_each_megatron_line_has_its_own_golden_file(version, line, name):
    assert golden_values.megatron_line(version) == line
    assert golden_values.golden_path("dp2", "cpu", line).name == name


def test_another_torch_release_leaves_the_values_out_and_says_why():
    golden = _golden()
    actual = _scale(_actual(golden), 1, "lm_loss", 1 + 3.6e-3)  # torch 2.8.0 vs 2.13.0
    _scale(actual, 3, "grad_norm", 1 + 4.7e-2)
    other_torch = dict(HERE, torch="2.8.0+cu128")
    result = golden_values.compare(actual, golden, other_torch)
    assert result.ok, result.mismatches
    assert "lm loss and grad norm not compared" in result.digests_left_out
    assert "2.8.0+cu128" in result.digests_left_out and "2.13.0+cu130" in result.digests_left_out
    # What does not depend on the kernels is still compared exactly.
    flipped = _actual(golden)
    flipped["iterations"][1]["skipped"] = 1 - flipped["iterations"][1]["skipped"]
    assert not golden_values.compare(flipped, golden, other_torch).ok
    # The same torch release with another build or patch number: the tolerance applies.
    patch_release = dict(ELSEWHERE, torch="2.13.1")
    assert not golden_values.compare(actual, golden, patch_release).ok
    assert golden_values.torch_release("2.13.0+cu130") == "2.13"
