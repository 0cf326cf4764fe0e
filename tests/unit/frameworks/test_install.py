"""Installing and removing the framework adapters (``megatron_offload.frameworks``)."""

from __future__ import annotations

import sys
import types

import pytest

from megatron_offload.frameworks import nemo_rl, phases, verl
from megatron_offload.interceptions import PROCESS


class _Offloader:
    def __init__(self, automatic):
        self.automatic, self.calls = automatic, []

    def offload(self):
        self.calls.append("offload")

    def reload(self):
        self.calls.append("reload")

    def wait(self):
        self.calls.append("wait")


class _Optimizer:
    def __init__(self, offloader=None):
        self._state_offloader = offloader


def test_phases_to_device_is_nothing_under_the_per_step_cycle():
    attached, manual = _Offloader(True), _Offloader(False)
    for offloader in (attached, manual):
        phases.to_host(offloader)
        phases.to_device(offloader)
    assert attached.calls == ["offload"]
    assert manual.calls == ["offload", "reload", "wait"]


def test_nemo_rl_install_delegates_only_with_an_offloader_and_uninstall_restores():
    class Worker:
        def __init__(self, optimizer):
            self.optimizer, self.own = optimizer, []

        def move_optimizer(self, device):
            self.own.append(device)

    own = Worker.move_optimizer
    nemo_rl.install(Worker)
    nemo_rl.install(Worker)  # idempotent
    try:
        offloader = _Offloader(False)
        served, plain = Worker(_Optimizer(offloader)), Worker(_Optimizer())
        for device in ("cpu", "cuda"):
            served.move_optimizer(device)
            plain.move_optimizer(device)
        assert offloader.calls == ["offload", "reload", "wait"] and served.own == []
        assert plain.own == ["cpu", "cuda"]
        with pytest.raises(ValueError, match="Only strings 'cpu' and 'cuda'"):
            served.move_optimizer("meta")
        assert [where for _, where, _ in PROCESS.listing()] == [
            f"{Worker.__qualname__}.move_optimizer"
        ]
    finally:
        nemo_rl.uninstall(Worker)
    assert Worker.move_optimizer is own and "move_optimizer" in vars(Worker)
    assert PROCESS.listing() == []


def test_verl_install_rebinds_every_module_that_imported_the_moves():
    from tests.harness.doubles import rl_frameworks

    utils, engine = rl_frameworks.verl_modules("verl_install_double")
    own = utils.offload_megatron_optimizer, utils.load_megatron_optimizer
    verl.install(utils)
    verl.install(utils)  # idempotent: not wrapped twice
    try:
        assert engine.offload_megatron_optimizer is utils.offload_megatron_optimizer is not own[0]
        assert utils.offload_megatron_optimizer.__wrapped__ is own[0]
        offloader = _Offloader(True)
        engine.offload_megatron_optimizer(_Optimizer(offloader))
        engine.load_megatron_optimizer(_Optimizer(offloader))
        assert offloader.calls == ["offload"]  # the step reloads under the per-step cycle
        listed = {where for _, where, _ in PROCESS.listing()}
        assert f"{engine.__name__}.offload_megatron_optimizer" in listed
        assert f"{utils.__name__}.load_megatron_optimizer" in listed
    finally:
        verl.uninstall(utils)
        for name in [n for n in sys.modules if n.startswith("verl_install_double")]:
            del sys.modules[name]
    assert (utils.offload_megatron_optimizer, utils.load_megatron_optimizer) == own
    assert (engine.offload_megatron_optimizer, engine.load_megatron_optimizer) == own
    assert PROCESS.listing() == []


def test_missing_frameworks_are_a_clear_error():
    with pytest.raises(ImportError, match=r"needs NeMo-RL's nemo_rl\.models\.policy\.workers"):
        nemo_rl.install()
    with pytest.raises(ImportError, match=r"needs verl's verl\.utils\.megatron_utils"):
        verl.install()
    with pytest.raises(TypeError, match="has no offload_megatron_optimizer"):
        verl.install(types.ModuleType("not_verl"))
    with pytest.raises(TypeError, match="has no move_optimizer of its own"):
        nemo_rl.install(type("NotAWorker", (), {}))
