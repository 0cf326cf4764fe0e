"""The megatron.training hooks: patch_megatron() (idempotent, a no-op without the flag), the
finalize_model_grads prefetch, checkpoint residency and the log line / scalars.

The wrapper logic is tested on stand-ins in this process; the same helpers then drive a real
DistributedOptimizer on the gloo rank pool (bitwise equal training, reload inside the
gradient finalization, residency around a checkpoint)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect

import pytest

from megatron_offload.access.state import Policy
from megatron_offload.interceptions import PROCESS, Interceptions
from megatron_offload.megatron import residency
from megatron_offload.megatron import training as hooks
from megatron_offload.megatron.arguments import OffloadArgumentError
from tests.harness.training_args import offload_args


# ------------------------------------------------------------------------------ stand-ins
class FakeOffloader:
    def __init__(self, events, offloaded=True):
        self.events = events
        self._offloaded = offloaded
        self.optimizer = None
        self.detached = False
        self.config = argparse.Namespace(offload_master_weights=True, prefetch="gradients")
        self.interceptions = Interceptions()
        # Served as the tests below say (they set residency.servable); never in a host view.
        self.access = argparse.Namespace(policies=(Policy.DEVICE,))

    @property
    def is_offloaded(self):
        return self._offloaded

    def reload(self):
        self.events.append("reload")
        self._offloaded = False

    def prefetch(self):  # as the offloader's: nothing to do when nothing is offloaded
        if self._offloaded:
            self.reload()

    def offload(self):
        self.events.append("offload")
        self._offloaded = True

    @contextlib.contextmanager
    def resident(self, *, read_only=False):
        self.events.append(("resident", read_only))
        yield self
        self.events.append(("offloaded again", read_only))

    def stats(self):
        return {
            "offloaded_bytes": 3 << 29,
            "host_bytes": 3 << 29,
            "offload_seconds": 0.0005,
            "reload_seconds": 0.00025,
            "d2h_ms": 12.5,
            "h2d_ms": 3.1,
            "d2h_gbps": 128.85,
            "h2d_gbps": 519.53,
            "exposed_ms": 0.4,
            "host_view_wait_ms": 2.5,
        }


class FakeOptimizer:
    """Stands in for a ChainedOptimizer whose DistributedOptimizer carries the offloader."""

    def __init__(self, offloader=None):
        inner = argparse.Namespace(_state_offloader=offloader)
        self.chained_optimizers = [inner]
        if offloader is not None:
            offloader.optimizer = self


@pytest.fixture
def megatron_args(monkeypatch):
    args = offload_args()
    monkeypatch.setattr(hooks, "_get_args", lambda: args)
    return args


# ------------------------------------------------------------------- patching and no-ops
@pytest.fixture
def megatron_training():
    arguments = pytest.importorskip("megatron.training.arguments")
    import megatron.training.training as training

    assert not hooks.is_patched()
    yield arguments, training
    hooks.unpatch_megatron()


def test_patch_is_idempotent_and_reversible(megatron_training):
    arguments, training = megatron_training
    names = [
        (arguments, "add_megatron_arguments"),
        (arguments, "validate_args"),
        (training, "setup_model_and_optimizer"),
        (training, "train"),
        (training, "save_checkpoint"),
        (training, "load_checkpoint"),
        (training, "calc_params_l2_norm"),
        (training, "training_log"),
    ]
    originals = [getattr(module, name) for module, name in names]
    hooks.patch_megatron()
    wrapped = [getattr(module, name) for module, name in names]
    assert all(w is not o for w, o in zip(wrapped, originals))
    assert all(w.__wrapped__ is o for w, o in zip(wrapped, originals))
    hooks.patch_megatron()
    assert [getattr(module, name) for module, name in names] == wrapped
    assert hooks.is_patched()
    # Listed where every change is: one row per wrapped function.
    listed = {where for _, where, _ in PROCESS.listing()}
    assert {f"{module.__name__}.{name}" for module, name in names} <= listed
    hooks.unpatch_megatron()
    assert [getattr(module, name) for module, name in names] == originals
    assert not hooks.is_patched() and PROCESS.listing() == []


def test_patch_reaches_the_validation_initialize_runs(megatron_training, monkeypatch):
    """megatron.training 0.17: pretrain() -> initialize_megatron() calls the validate_args it
    imported into megatron.training.initialize; that name must be wrapped too, so a refused
    combination stops before torch.distributed is initialized."""
    arguments, _ = megatron_training
    import megatron.training.initialize as initialize

    monkeypatch.setattr(initialize, "validate_args", arguments.validate_args, raising=False)
    original = initialize.validate_args
    hooks.patch_megatron()
    assert initialize.validate_args is not original
    assert initialize.validate_args.__wrapped__ is original
    with pytest.raises(OffloadArgumentError, match="--optimizer-cpu-offload"):
        initialize.validate_args(
            argparse.Namespace(
                offload_optimizer_states=True,
                use_distributed_optimizer=True,
                optimizer_cpu_offload=True,
            )
        )
    hooks.unpatch_megatron()
    assert initialize.validate_args is original


def test_patched_parser_has_the_flags(megatron_training):
    arguments, _ = megatron_training
    hooks.patch_megatron()
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--offload-optimizer-states", "--use-distributed-optimizer"])
    assert args.offload_optimizer_states and args.offload_prefetch is None  # the default


def test_validate_wrapper_checks_before_and_after_megatron():
    calls = []

    def megatron_validate(args, defaults={}):
        calls.append("megatron")
        # A refusal only the validated namespace shows (Megatron derives flags from others).
        args.freeze_all_layers = True
        return args

    validate = hooks._wrap_validate_args(megatron_validate)
    with pytest.raises(OffloadArgumentError, match="--optimizer-cpu-offload"):
        validate(
            argparse.Namespace(
                offload_optimizer_states=True,
                optimizer_cpu_offload=True,
                use_distributed_optimizer=True,
            )
        )
    assert calls == []  # refused before Megatron's own checks ran
    with pytest.raises(OffloadArgumentError, match="--freeze-all-layers"):
        validate(argparse.Namespace(offload_optimizer_states=True, use_distributed_optimizer=True))
    assert calls == ["megatron"]
    plain = argparse.Namespace(use_distributed_optimizer=True)
    assert validate(plain) is plain  # without the flag: Megatron's result, untouched


def _train(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    process_non_loss_data_func,
    config,
    checkpointing_context,
    non_loss_data_func,
    inference_model=None,
    p2p_communicator=None,
    pg_collection=None,
):
    """The signature of megatron.training.training.train; runs two 'iterations'."""
    config.seen = config.finalize_model_grads_func
    for _ in range(2):
        config.finalize_model_grads_func()
    return "trained"


def _train_signature(body):
    """A function with ``train``'s signature (``_train``'s, which the wrapper binds by name)
    whose call runs ``body(config)``."""

    @functools.wraps(_train)
    def train(*args, **kwargs):
        return body(inspect.signature(_train).bind(*args, **kwargs).arguments["config"])

    return train


def _call_train(train, optimizer, config):
    return train(None, [], optimizer, None, None, None, None, config, {}, None)


def test_train_without_offloader_is_untouched(megatron_args):
    seen = []

    @_train_signature
    def train(config):
        seen.append(config.finalize_model_grads_func)
        return "trained"

    module = argparse.Namespace(finalize_model_grads=lambda: None)
    config = argparse.Namespace(finalize_model_grads_func=None)
    assert _call_train(hooks._wrap_train(train, module), FakeOptimizer(), config) == "trained"
    assert seen == [None] and config.finalize_model_grads_func is None


@pytest.mark.parametrize("builder_hook", [False, True])
def test_prefetch_wraps_finalize_and_restores_it(megatron_args, builder_hook):
    events = []
    offloader = FakeOffloader(events)
    optimizer = FakeOptimizer(offloader)

    def finalize_model_grads(*args, **kwargs):
        events.append("default finalize")

    def builder_finalize(*args, **kwargs):
        events.append("builder finalize")

    module = argparse.Namespace(finalize_model_grads=finalize_model_grads)
    config = argparse.Namespace(
        finalize_model_grads_func=builder_finalize if builder_hook else None
    )
    before = config.finalize_model_grads_func
    assert _call_train(hooks._wrap_train(_train, module), optimizer, config) == "trained"
    name = "builder finalize" if builder_hook else "default finalize"
    # The reload starts first, then the (kept) gradient finalization runs; once reloaded,
    # the next finalization does not reload again.
    assert events == ["reload", name, name]
    assert config.seen.__wrapped__ is (builder_finalize if builder_hook else finalize_model_grads)
    assert config.finalize_model_grads_func is before  # restored after train()


def test_prefetch_survives_a_train_that_assigns_the_default(megatron_args):
    """megatron.training 0.17 and 0.18: train() assigns the module's finalize_model_grads to
    the config whatever was there; the prefetch must still run, and the name is restored."""
    events = []
    optimizer = FakeOptimizer(FakeOffloader(events))

    def finalize_model_grads(*args, **kwargs):
        events.append("default finalize")

    module = argparse.Namespace(finalize_model_grads=finalize_model_grads)

    @_train_signature
    def train_018(config):
        config.finalize_model_grads_func = module.finalize_model_grads  # unconditionally
        for _ in range(2):
            config.finalize_model_grads_func()
        return "trained"

    config = argparse.Namespace(finalize_model_grads_func=None)
    assert _call_train(hooks._wrap_train(train_018, module), optimizer, config) == "trained"
    assert events == ["reload", "default finalize", "default finalize"]
    assert module.finalize_model_grads is finalize_model_grads
    assert config.finalize_model_grads_func is None


def test_prefetch_at_the_step_and_idempotent_install(megatron_args):
    events = []
    offloader = FakeOffloader(events)
    optimizer = FakeOptimizer(offloader)
    config = argparse.Namespace(finalize_model_grads_func=lambda: events.append("finalize"))
    offloader.config.prefetch = "step"  # --offload-prefetch step: nothing in the reduction
    assert not hooks.install_prefetch(config, optimizer, megatron_args)
    offloader.config.prefetch = "gradients"
    assert hooks.install_prefetch(config, optimizer, megatron_args)
    once = config.finalize_model_grads_func
    assert hooks.install_prefetch(config, optimizer, megatron_args)
    assert config.finalize_model_grads_func is once  # not wrapped twice
    assert not hooks.install_prefetch(config, FakeOptimizer(), megatron_args)  # no offloader
    config.finalize_model_grads_func()
    assert events == ["reload", "finalize"]


def test_prefetch_skips_a_detached_offloader():
    events = []
    offloader = FakeOffloader(events)
    optimizer = FakeOptimizer(offloader)
    finalize = hooks.prefetching_finalize(lambda: events.append("finalize"), offloader)
    del optimizer.chained_optimizers[0]._state_offloader  # what detach() does
    offloader.detached = True
    finalize()
    assert events == ["finalize"]


def test_checkpoints_are_served_from_the_host_copy(megatron_args, monkeypatch):
    """Where the offloader can serve checkpoints from its host copy, the checkpoint wrappers
    bring nothing back: the optimizer's own checkpoint methods read the host copy."""
    events = []
    monkeypatch.setattr(residency, "servable", lambda offloader: True)
    optimizer = FakeOptimizer(FakeOffloader(events))
    save = hooks._wrap_checkpoint(
        lambda iteration, model, optimizer: events.append("save"), read_only=True
    )
    load = hooks._wrap_checkpoint(lambda model, optimizer: events.append("load"), read_only=False)
    save(3, [], optimizer)
    load([], optimizer)
    assert events == ["save", "load"]


def test_checkpoints_run_with_resident_states(megatron_args, monkeypatch):
    """Where it cannot (Transformer Engine's fp16 or FP8 moments), the states are resident
    for the checkpoint and offloaded again right after it."""
    events = []
    monkeypatch.setattr(residency, "servable", lambda offloader: False)
    optimizer = FakeOptimizer(FakeOffloader(events))

    def save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *rest, **kwargs):
        events.append("save")

    def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, *rest, **kwargs):
        events.append("load")
        return 7, 0

    hooks._wrap_checkpoint(save_checkpoint, read_only=True)(3, [], optimizer, None)
    hooks._wrap_checkpoint(save_checkpoint, read_only=True)(
        3, [], optimizer=optimizer, opt_param_scheduler=None
    )
    assert hooks._wrap_checkpoint(load_checkpoint, read_only=False)([], optimizer, None) == (7, 0)
    hooks._wrap_checkpoint(save_checkpoint, read_only=True)(3, [], None, None)  # no optimizer
    assert events == [
        ("resident", True),
        "save",
        ("offloaded again", True),
        ("resident", True),
        "save",
        ("offloaded again", True),
        ("resident", False),
        "load",
        ("offloaded again", False),
        "save",
    ]


@pytest.mark.parametrize("served", [True, False])
def test_a_load_before_the_first_offload_is_offloaded_right_after(
    megatron_args, monkeypatch, served
):
    """A resumed run loads before its first step, with nothing offloaded yet: what the load
    made is offloaded after it, not carried through the first forward and backward."""
    events = []
    monkeypatch.setattr(residency, "servable", lambda offloader: served)
    optimizer = FakeOptimizer(FakeOffloader(events, offloaded=False))
    load = hooks._wrap_checkpoint(lambda model, optimizer: events.append("load"), read_only=False)
    load([], optimizer)
    save = hooks._wrap_checkpoint(lambda i, model, optimizer: events.append("save"), read_only=True)
    save(1, [], optimizer)  # offloaded now: a save adds nothing after itself
    inside = ["load"] if served else [("resident", False), "load", ("offloaded again", False)]
    after_save = ["save"] if served else [("resident", True), "save", ("offloaded again", True)]
    assert events == inside + ["offload"] + after_save


def test_asynchronous_saves_that_keep_references_are_left_to_the_guard(megatron_args, monkeypatch):
    events = []
    monkeypatch.setattr(residency, "servable", lambda offloader: False)  # as above
    optimizer = FakeOptimizer(FakeOffloader(events))
    save = hooks._wrap_checkpoint(
        lambda iteration, model, optimizer: events.append("save"), read_only=True
    )
    megatron_args.async_save, megatron_args.async_strategy = True, "mcore"
    save(1, [], optimizer)  # megatron-core's own async save stages the tensors before returning
    megatron_args.async_strategy = "nvrx"
    save(2, [], optimizer)  # may hold references: not offloaded again behind its back
    assert events == [("resident", True), "save", ("offloaded again", True), "save"]
    assert hooks.save_is_staged_on_return(argparse.Namespace())


def test_megatron_fsdp_saves_and_loads_run_in_a_host_view(megatron_args):
    """Under Megatron-FSDP (the policy ``HOST_VIEW``, with any ``HOST_COPY`` beside it) a
    synchronous save runs whole in a host view, and so does a load (writing) where the states
    it writes into can be made without an update (``loads_in_view``); an asynchronous save,
    whose writer may read after it returned, and a load where they cannot (an optimizer built
    without a state initializer) have the states resident."""
    events = []
    offloader = FakeOffloader(events)

    @contextlib.contextmanager
    def host_view(*, writes=False):
        events.append(("host view", writes))
        yield offloader
        events.append("view closed")

    def access(*policies, loads_in_view=True):
        return argparse.Namespace(policies=policies, loads_in_view=lambda: loads_in_view)

    offloader.host_view = host_view
    offloader.access = access(Policy.HOST_COPY, Policy.HOST_VIEW)
    optimizer = FakeOptimizer(offloader)
    save = hooks._wrap_checkpoint(lambda i, model, optimizer: events.append("save"), read_only=True)
    load = hooks._wrap_checkpoint(lambda model, optimizer: events.append("load"), read_only=False)
    save(1, [], optimizer)
    load([], optimizer)
    offloader.access = access(Policy.HOST_COPY, Policy.HOST_VIEW, loads_in_view=False)
    load([], optimizer)
    megatron_args.async_save, megatron_args.async_strategy = True, "mcore"
    save(2, [], optimizer)
    assert events == [
        ("host view", False),
        "save",
        "view closed",
        ("host view", True),
        "load",
        "view closed",
        ("resident", False),
        "load",
        ("offloaded again", False),
        ("resident", True),
        "save",
        ("offloaded again", True),
    ]
    # With an optimizer that needs the device (Transformer Engine's FP8 moments) beside it,
    # no view: the states come back.
    events.clear()
    megatron_args.async_save = False
    offloader.access = access(Policy.DEVICE, Policy.HOST_VIEW)
    save(3, [], optimizer)
    load([], optimizer)
    assert events == [
        ("resident", True),
        "save",
        ("offloaded again", True),
        ("resident", False),
        "load",
        ("offloaded again", False),
    ]


def test_training_log_logs_at_each_log_interval(megatron_args, monkeypatch):
    logged = []
    monkeypatch.setattr(hooks, "log_for_megatron", logged.append)

    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
        max_attention_logit,
        pg_collection=None,
        is_first_iteration=False,
        **kwargs,
    ):
        return report_memory_flag

    wrapped = hooks._wrap_training_log(training_log)
    for iteration in range(1, 6):
        assert (
            wrapped(
                {},
                {},
                1e-3,
                iteration,
                1.0,
                "flag",
                0,
                1.0,
                None,
                None,
                0,
                is_first_iteration=iteration == 1,
            )
            == "flag"
        )
    assert logged == [1, 2, 4]


def test_log_line_and_scalars():
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, name, value, iteration):
            self.scalars.append((name, value, iteration))

    class Wandb:
        def __init__(self):
            self.logged = []

        def log(self, values, iteration):
            self.logged.append((values, iteration))

    writer, wandb, printed = Writer(), Wandb(), []
    figures = hooks.log_offload_stats(
        10, FakeOffloader([]), writer=writer, wandb_writer=wandb, printer=printed.append
    )
    assert figures == {
        "offloaded_gib": 1.5,
        "host_gib": 1.5,
        "d2h_ms": 12.5,
        "d2h_gbps": 128.85,
        "h2d_ms": 3.1,
        "h2d_gbps": 519.53,
        "exposed_ms": 0.4,
        "issue_ms": pytest.approx(0.75),
        "checkpoint_wait_ms": 2.5,
    }
    assert printed == [
        " [optimizer-state offload] iteration       10 | offloaded: 1.500 GiB"
        " | host: 1.500 GiB | D2H: 12.500 ms (128.85 GB/s)"
        " | H2D: 3.100 ms (519.53 GB/s) | exposed: 0.400 ms | issue: 0.750 ms |"
        " checkpoint wait: 2.500 ms |"
    ]
    assert [(name, iteration) for name, _, iteration in writer.scalars] == [
        ("optimizer-offload/offloaded-GiB", 10),
        ("optimizer-offload/host-GiB", 10),
        ("optimizer-offload/d2h-ms", 10),
        ("optimizer-offload/d2h-GBps", 10),
        ("optimizer-offload/h2d-ms", 10),
        ("optimizer-offload/h2d-GBps", 10),
        ("optimizer-offload/exposed-ms", 10),
        ("optimizer-offload/issue-ms", 10),
        ("optimizer-offload/checkpoint-wait-ms", 10),
    ]
    assert wandb.logged == [({name: value for name, value, _ in writer.scalars}, 10)]


def test_rates_are_the_minimum_over_ranks_and_times_the_maximum(monkeypatch):
    from megatron_offload import report as stats_log

    other_rank = {
        "offloaded_bytes": 1 << 30,
        "host_bytes": 1 << 30,
        "offload_seconds": 0.002,
        "reload_seconds": 0.001,
        "d2h_ms": 20.0,
        "h2d_ms": 1.0,
        "d2h_gbps": 50.0,
        "h2d_gbps": 900.0,
        "exposed_ms": 0.1,
    }
    theirs = list(stats_log.offload_figures(other_rank).items())

    def two_ranks(values):  # what a MAX all-reduce with the other rank returns
        signs = [-1.0 if k in stats_log.MIN_OVER_RANKS else 1.0 for k, _ in theirs]
        return [max(v, s * t) for v, s, (_, t) in zip(values, signs, theirs)], 2

    monkeypatch.setattr(stats_log, "_max_over_ranks", two_ranks)
    printed = []
    figures = stats_log.log_offload_stats(4, FakeOffloader([]), printer=printed.append)
    assert figures["d2h_gbps"] == 50.0 and figures["h2d_gbps"] == 519.53  # the slower rank
    assert figures["d2h_ms"] == 20.0 and figures["h2d_ms"] == 3.1  # the longer one
    assert figures["issue_ms"] == pytest.approx(3.0) and figures["exposed_ms"] == 0.4
    assert printed[0].endswith("| (max over 2 ranks; GB/s: min)")


def test_attach_for_training_needs_the_flag():
    assert hooks.attach_for_training(object(), argparse.Namespace()) is None
    assert hooks.attach_for_training(None, offload_args()) is None
    existing = FakeOffloader([])
    assert hooks.attach_for_training(FakeOptimizer(existing), offload_args()) is existing


# ----------------------------------------------------------------------------- the launcher
def test_launcher_usage_and_errors(capsys):
    from megatron_offload import launch

    with pytest.raises(SystemExit) as exit_info:
        launch.main([])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--help"])
    assert exit_info.value.code == 0
    assert "megatron_offload.launch SCRIPT.py" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["/no/such/script.py"])
    assert exit_info.value.code == 2
    assert "no such script" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["-m"])  # a module name is missing
    assert exit_info.value.code == 2
    assert "megatron_offload.launch SCRIPT.py" in capsys.readouterr().err


@pytest.mark.parametrize("as_module", [False, True])
def test_launcher_patches_then_runs_the_script_as_main(
    megatron_training, tmp_path, monkeypatch, as_module
):
    import json
    import sys

    from megatron_offload import launch

    script = tmp_path / "my_pretrain.py"
    out = tmp_path / "out.json"
    script.write_text(
        "import json, sys\n"
        "from megatron_offload.megatron import training\n"
        'if __name__ == "__main__":\n'
        '    record = {"argv": sys.argv[1:], "patched": training.is_patched()}\n'
        f'    json.dump(record, open({str(out)!r}, "w"))\n'
    )
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if as_module:
        monkeypatch.syspath_prepend(str(tmp_path))
        launch.main(["-m", "my_pretrain", "--offload-optimizer-states", "--lr", "1e-4"])
    else:
        launch.main([str(script), "--offload-optimizer-states", "--lr", "1e-4"])
    assert json.loads(out.read_text()) == {
        "argv": ["--offload-optimizer-states", "--lr", "1e-4"],
        "patched": True,
    }
    sys.modules.pop("my_pretrain", None)


# ------------------------------------------------------------------- the remaining paths
def test_prefetch_installs_megatrons_finalize_when_none_is_set(megatron_args):
    from megatron.core.distributed import finalize_model_grads

    events = []
    config = argparse.Namespace(finalize_model_grads_func=None)
    assert hooks.install_prefetch(config, FakeOptimizer(FakeOffloader(events)), megatron_args)
    assert config.finalize_model_grads_func.__wrapped__ is finalize_model_grads


def test_train_without_prefetch_keeps_the_finalize_hook(megatron_args):
    events = []
    offloader = FakeOffloader(events)
    optimizer = FakeOptimizer(offloader)
    config = argparse.Namespace(finalize_model_grads_func=None)
    offloader.config.prefetch = "step"

    def train_that_sets_its_own(*args, config=None, **kwargs):  # as megatron's train() does
        if config.finalize_model_grads_func is None:
            config.finalize_model_grads_func = lambda: events.append("finalize")
        return _train(*args, config=config, **kwargs)

    import functools

    train_that_sets_its_own = functools.wraps(_train)(train_that_sets_its_own)
    train = hooks._wrap_train(
        train_that_sets_its_own, argparse.Namespace(finalize_model_grads=None)
    )
    assert (
        train(
            None,
            [],
            optimizer,
            None,
            None,
            None,
            None,
            config=config,
            checkpointing_context={},
            non_loss_data_func=None,
        )
        == "trained"
    )
    assert events == ["finalize", "finalize"]  # train()'s own hook, no reload wrapped around it


def test_detached_offloaders_are_forgotten_and_the_norm_runs_without_them(monkeypatch):
    import weakref

    offloader = FakeOffloader([])
    offloader.detached = True
    monkeypatch.setattr(hooks, "_ATTACHED", [weakref.ref(offloader)])
    assert hooks._active_offloaders() == [] and hooks._ATTACHED == []
    assert hooks._wrap_params_norm(lambda: 7.0)() == 7.0


def test_log_for_megatron_does_nothing_without_the_flag_or_an_offloader(monkeypatch):
    global_vars = pytest.importorskip("megatron.training.global_vars")
    args = offload_args()
    monkeypatch.setattr(global_vars, "get_args", lambda: args)
    monkeypatch.setattr(hooks, "_ATTACHED", [])
    args.offload_log_stats = False
    assert hooks.log_for_megatron(2) is None
    args.offload_log_stats = None
    assert hooks.log_for_megatron(2) is None  # no offloader attached


def test_without_megatron_training_messages_go_to_stdout(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "megatron.training.utils", None)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", None)
    from megatron_offload import report

    hooks._print_rank_0("first")
    report._print_rank_last("last")
    assert capsys.readouterr().out == "first\nlast\n"
    from megatron_offload.megatron.residency import _megatron_args_or_none

    assert _megatron_args_or_none() is None


def test_prefetch_is_not_installed_inside_a_full_iteration_graph(megatron_args):
    """Under cuda_graph_impl="full_iteration" the finalize runs inside the captured graph: the
    source patches' install leaves it alone (the step starts the reload), with a warning."""
    import warnings

    optimizer = FakeOptimizer(FakeOffloader([]))

    def finalize_model_grads(*args, **kwargs):
        pass

    config = argparse.Namespace(
        finalize_model_grads_func=finalize_model_grads, cuda_graph_impl="full_iteration"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not hooks.install_prefetch(config, optimizer, megatron_args)
    assert config.finalize_model_grads_func is finalize_model_grads
    assert any("captured graph" in str(w.message) for w in caught)
