"""OffloadConfig: every option checked where it is made, each refusal naming the option and its flag; the package's exceptions are the built-in ones callers expect."""

from __future__ import annotations

import pytest

from megatron_offload import OffloadConfig, OffloadStateError


def test_config_refuses_bad_values_naming_the_option():
    with pytest.raises(
        TypeError,
        match=r"offload_optimizer_states \(--offload-optimizer-states\) must be True or False",
    ):
        OffloadConfig(offload_optimizer_states=1)
    with pytest.raises(TypeError, match="callable"):
        OffloadConfig(device_factory="cuda")
    with pytest.raises(
        ValueError, match=r"offload_fraction \(--offload-fraction\) must be a number from 0 to 1"
    ):
        OffloadConfig(offload_fraction=2)
    with pytest.raises(
        ValueError,
        match=r"host_memory_budget \(--offload-host-memory-budget\) must be a number of bytes",
    ):
        OffloadConfig(host_memory_budget=-1)
    with pytest.raises(
        TypeError, match=r"per_optimizer \(--offload-per-optimizer\) keys are optimizer indices"
    ):
        OffloadConfig(per_optimizer={"experts": {}})
    with pytest.raises(TypeError, match=r"per_optimizer\[1\] must be a dict"):
        OffloadConfig(per_optimizer={1: True})
    with pytest.raises(TypeError, match="unknown option 'offload_fraction'"):
        OffloadConfig(per_optimizer={1: {"offload_fraction": 0.5}})
    with pytest.raises(TypeError, match=r"\[1\]\['offload_master_weights'\] must be True or False"):
        OffloadConfig(per_optimizer={1: {"offload_master_weights": "no"}})
    assert OffloadConfig(per_optimizer={1: {"offload_master_weights": False}}).kinds(1) == (
        "optimizer_states",
    )
    for bad in ("finalize", 0, 1.0, True):  # "gradients", "step" and fractions are the points
        with pytest.raises(
            ValueError,
            match=r'prefetch \(--offload-prefetch\) must be "gradients", "step" or a fraction',
        ):
            OffloadConfig(prefetch=bad)
    for bad in (0, -5, 1.5, True, "1GiB"):
        with pytest.raises(
            ValueError,
            match=r"chunked_update_bytes \(--offload-chunked-update-bytes\) must be a number of bytes",
        ):
            OffloadConfig(chunked_update_bytes=bad)
    for bad in (0, 2.0, True):
        with pytest.raises(
            ValueError,
            match=r"chunked_update_slots \(--offload-chunked-update-slots\) must be an int >= 1",
        ):
            OffloadConfig(chunked_update_bytes=1 << 20, chunked_update_slots=bad)
    with pytest.raises(
        ValueError, match=r"cannot be combined with offload_fraction \(--offload-fraction\) < 1"
    ):
        OffloadConfig(chunked_update_bytes=1 << 20, offload_fraction=0.5)
    with pytest.raises(ValueError, match="too small for 4 slot"):
        OffloadConfig(chunked_update_bytes=32, chunked_update_slots=4)
    assert (
        OffloadConfig(chunked_update_bytes=1 << 20, chunked_update_slots=1).chunked_update_slots
        == 1
    )
    for bad in (0, 1, "yes", None):
        with pytest.raises(
            TypeError,
            match=r"chunked_update_undo \(--offload-chunked-update-undo\) must be True or False",
        ):
            OffloadConfig(chunked_update_bytes=1 << 20, chunked_update_undo=bad)
    assert OffloadConfig().chunked_update_undo is False  # opt-in: it costs a copy and host memory


def test_offload_state_error_is_a_runtime_error():
    assert issubclass(OffloadStateError, RuntimeError)


def test_pr_2811s_name_of_the_master_weights_is_an_alias():
    from megatron_offload.offloader.members import master_weights_option

    config = OffloadConfig.from_options(offload_primary_weights=False)
    assert config.offload_master_weights is False and config.kinds() == ("optimizer_states",)
    assert OffloadConfig(per_optimizer={0: {"offload_primary_weights": False}}).kinds(0) == (
        "optimizer_states",
    )
    with pytest.raises(TypeError, match="another name of offload_master_weights"):
        OffloadConfig.from_options(offload_primary_weights=False, offload_master_weights=True)
    assert master_weights_option(None, False) is False and master_weights_option(True, None)
    assert master_weights_option(None, None) is None
    with pytest.raises(TypeError, match="another name of offload_master_weights"):
        master_weights_option(True, False)
