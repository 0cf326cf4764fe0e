"""A Megatron with an optimizer-state offloader of its own (Megatron-LM dev): its
--offload-optimizer-states is a deprecated alias of --chunked-optimizer-state-offload, and
OptimizerConfig(offload_optimizer_states=True) turns that offloader on. Run through
megatron-offload, the flag selects megatron-offload's offloader, Megatron's stays off, both
together are refused before anything is built, and one log line says which one is active.

Megatron-LM dev is not installable here: the parser is megatron-core 0.19.2's with dev's four
flags added the way dev defines them, and the OptimizerConfig a subclass with dev's fields and
__post_init__ normalization."""

from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest

from megatron_offload.config import flag
from megatron_offload.megatron import coexistence
from megatron_offload.megatron import training as hooks
from megatron_offload.megatron.arguments import (
    CHUNKED_FLAG,
    SWITCH,
    OffloadArgumentError,
    add_arguments,
    config_from_args,
    validate_args,
)
from megatron_offload.megatron.arguments import _flags as our_flags

OFFLOAD_FLAG = SWITCH
PIECE_FLAG = flag("max_piece_bytes")

MEGATRON_FLAG = "--chunked-optimizer-state-offload"
OK_BASE = [OFFLOAD_FLAG, "--use-distributed-optimizer", "--bf16"]
OUR_FLAGS = [option for option, _ in our_flags()]


# --------------------------------------------------------------------- dev, as dev defines it
def add_dev_offloader_flags(parser):
    """megatron/training/arguments.py (dev): its own offloader's flags and the alias."""
    group = parser.add_argument_group(title="dev optimizer state offload")
    group.add_argument(
        MEGATRON_FLAG,
        action="store_true",
        help="Keep selected optimizer tensor states and master weights in CPU "
        "memory between updates.",
    )
    group.add_argument(
        "--optimizer-state-offload-chunk-size-mb",
        type=int,
        default=0,
        help="Target size of each optimizer tensor-state staging buffer in MiB.",
    )
    group.add_argument(
        "--optimizer-state-offload-fraction",
        type=float,
        default=1.0,
        help="Fraction of optimizer parameter bundles to offload.",
    )
    group.add_argument(
        OFFLOAD_FLAG,
        action="store_true",
        dest="offload_optimizer_states",
        help="Deprecated spelling for --chunked-optimizer-state-offload. It "
        "automatically enables the replacement.",
    )
    return parser


def dev_parser():
    arguments = pytest.importorskip("megatron.training.arguments")
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return add_dev_offloader_flags(parser)


def dev_optimizer_config_class():
    """megatron/core/optimizer/optimizer_config.py (dev): the fields and the alias rewrite."""
    from megatron.core.optimizer import OptimizerConfig

    @dataclasses.dataclass
    class DevOptimizerConfig(OptimizerConfig):
        chunked_optimizer_state_offload: bool = False
        optimizer_state_offload_chunk_size_mb: int = 0
        optimizer_state_offload_fraction: float = 1.0
        offload_optimizer_states: bool = False

        def __post_init__(self):
            if self.offload_optimizer_states:
                warnings.warn(
                    "offload_optimizer_states is deprecated; use "
                    "chunked_optimizer_state_offload instead.",
                    FutureWarning,
                    stacklevel=2,
                )
                self.chunked_optimizer_state_offload = True
                self.offload_optimizer_states = False
            super().__post_init__()

    return DevOptimizerConfig


def map_dtypes(args):
    """What Megatron's validate_args does to the dtypes OptimizerConfig checks."""
    import torch

    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for dest in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        value = getattr(args, dest)
        setattr(args, dest, names.get(value, value))
    return args


def dev_validate_args(args, defaults={}):
    """The part of dev's validate_args that reads the alias (plus, as a later Megatron might,
    normalizing it into the args themselves)."""
    dev_validate_args.seen.append(args.offload_optimizer_states)
    map_dtypes(args)
    if (args.chunked_optimizer_state_offload or args.offload_optimizer_states) and (
        args.optimizer_state_offload_fraction > 0.0
    ):
        if not args.no_save_optim or not args.no_load_optim:
            assert args.ckpt_format == "torch_dist", (
                "chunked optimizer state offload requires --ckpt-format torch_dist"
            )
        args.chunked_optimizer_state_offload = True


dev_validate_args.seen = []


class Offloader:
    engines = [object()]
    detached = False
    config = argparse.Namespace(prefetch="gradients")


class Optimizer:
    """A ChainedOptimizer stand-in whose one inner optimizer has ``config``."""

    def __init__(self, config=None, megatron_offloader=None):
        inner = argparse.Namespace(
            _state_offloader=None, config=config, _optimizer_state_offloader=megatron_offloader
        )
        self.chained_optimizers = [inner]


@pytest.fixture
def printed(monkeypatch):
    lines = []
    monkeypatch.setattr(hooks, "_print_rank_0", lines.append)
    return lines


@pytest.fixture
def attached(monkeypatch):
    calls = []

    def attach(optimizer, config):
        calls.append(config)
        return Offloader()

    monkeypatch.setattr(hooks, "attach", attach)
    monkeypatch.setattr(hooks, "_ATTACHED", [])
    return calls


# ------------------------------------------------------------------------------ the parser
def test_megatrons_flag_is_taken_over_and_every_tuning_flag_added():
    parser = dev_parser()
    megatrons = parser._option_string_actions[OFFLOAD_FLAG]
    # What the early return used to leave: none of the tuning flags.
    assert PIECE_FLAG not in parser._option_string_actions
    with pytest.raises(argparse.ArgumentError, match="conflicting option"):
        argparse.ArgumentParser.add_argument(parser, OFFLOAD_FLAG, action="store_true")

    assert add_arguments(parser) is parser
    assert add_arguments(parser) is parser  # idempotent on a taken-over flag too
    for option in OUR_FLAGS:
        assert option in parser._option_string_actions, option
    assert parser._option_string_actions[OFFLOAD_FLAG] is megatrons  # one action, one dest
    assert [a for a in parser._actions if a.dest == "offload_optimizer_states"] == [megatrons]
    assert megatrons.help.startswith("Keep the optimizer's states")
    assert "megatron-offload's offloader" in megatrons.help and "alias" in megatrons.help
    # Renders (megatron-core 0.19.2's own --help fails on another flag's bare '%').
    assert parser._get_formatter()._expand_help(megatrons) == megatrons.help

    args = parser.parse_args(
        OK_BASE + [PIECE_FLAG, str(64 << 20), CHUNKED_FLAG, "4096", "--offload-prefetch", "step"]
    )
    assert args.offload_optimizer_states is True and args.chunked_optimizer_state_offload is False
    assert args.offload_max_piece_bytes == 64 << 20 and args.offload_chunked_update_bytes == 4096
    assert args.offload_prefetch == "step" and args.offload_master_weights is None
    validate_args(args)
    config = config_from_args(args)
    assert config.max_piece_bytes == 64 << 20 and config.chunked_update_bytes == 4096
    validate_args(parser.parse_args([]))  # without any flag: nothing to judge


def _parser_with(*option_strings, **kwargs):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument(*option_strings, **kwargs)
    return parser


@pytest.mark.parametrize(
    "parser, expected",
    [
        pytest.param(
            _parser_with(OFFLOAD_FLAG, type=int, default=None),
            [OFFLOAD_FLAG, "differently"],
            id="main-flag-takes-a-value",
        ),
        pytest.param(
            _parser_with(OFFLOAD_FLAG, action="store_true", dest="offload_states"),
            [OFFLOAD_FLAG, "differently", "'offload_states'"],
            id="main-flag-other-dest",
        ),
        pytest.param(
            _parser_with(PIECE_FLAG, type=int, default=None, dest="offload_max_piece_mib"),
            [PIECE_FLAG, f"it defines {PIECE_FLAG} itself"],
            id="tuning-flag-same-name",
        ),
        pytest.param(
            _parser_with("--megatron-prefetch", action="store_false", dest="offload_prefetch"),
            [
                "--offload-prefetch",
                "--megatron-prefetch",
                "already stores into args.offload_prefetch",
            ],
            id="tuning-dest-taken",
        ),
    ],
)
def test_a_flag_megatron_defines_otherwise_is_refused_clearly(parser, expected):
    with pytest.raises(OffloadArgumentError) as error:
        add_arguments(parser)
    for text in expected + ["share one value", "megatron-offload release"]:
        assert text in str(error.value), f"{text!r} not in: {error.value}"


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("extra", [[MEGATRON_FLAG], [MEGATRON_FLAG, "--ckpt-format", "torch"]])
def test_both_offloaders_are_refused_before_megatron_runs(extra):
    args = add_arguments(dev_parser()).parse_args(OK_BASE + extra)
    dev_validate_args.seen = []
    with pytest.raises(OffloadArgumentError) as error:
        hooks._wrap_validate_args(dev_validate_args)(args)
    message = str(error.value)
    assert OFFLOAD_FLAG in message and MEGATRON_FLAG in message and "only one" in message
    assert f"Drop {MEGATRON_FLAG}" in message and f"drop {OFFLOAD_FLAG}" in message
    assert dev_validate_args.seen == []  # refused before Megatron's checks (or anything else)


@pytest.mark.parametrize(
    "option, value",
    [
        ("--optimizer-state-offload-chunk-size-mb", "512"),
        ("--optimizer-state-offload-fraction", "0.5"),
        ("--optimizer-state-offload-fraction", "0"),
    ],
)
def test_megatrons_tuning_flags_are_refused_with_ours(option, value):
    parser = add_arguments(dev_parser())
    with pytest.raises(OffloadArgumentError) as error:
        validate_args(parser.parse_args(OK_BASE + [option, value]))
    for text in (option, MEGATRON_FLAG, OFFLOAD_FLAG, "no effect"):
        assert text in str(error.value)
    # Without ours they are Megatron's business (its own offloader, or nothing).
    validate_args(parser.parse_args([MEGATRON_FLAG, "--use-distributed-optimizer", option, value]))


def test_megatrons_validate_args_does_not_see_the_alias():
    args = add_arguments(dev_parser()).parse_args(OK_BASE + ["--ckpt-format", "torch"])
    # Negative control: Megatron's own validation reads our flag as its offloader's alias.
    plain = argparse.Namespace(**vars(args))
    dev_validate_args.seen = []
    with pytest.raises(AssertionError, match="requires --ckpt-format torch_dist"):
        dev_validate_args(plain)
    torch_dist = argparse.Namespace(**{**vars(args), "ckpt_format": "torch_dist"})
    dev_validate_args(torch_dist)
    assert torch_dist.chunked_optimizer_state_offload is True  # what would run both

    dev_validate_args.seen = []
    hooks._wrap_validate_args(dev_validate_args)(args)
    assert dev_validate_args.seen == [False]
    assert args.offload_optimizer_states is True and args.chunked_optimizer_state_offload is False


def test_megatrons_offloader_alone_is_left_alone():
    args = add_arguments(dev_parser()).parse_args(
        [MEGATRON_FLAG, "--use-distributed-optimizer", "--ckpt-format", "torch_dist"]
    )
    dev_validate_args.seen = []
    hooks._wrap_validate_args(dev_validate_args)(args)
    assert args.chunked_optimizer_state_offload is True and not args.offload_optimizer_states
    with coexistence.alias_hidden(args, dev_optimizer_config_class()):
        assert args.offload_optimizer_states is False


# ------------------------------------------------------------ patch_megatron() end to end
@pytest.fixture
def dev_megatron(monkeypatch):
    """megatron.training 0.19.2 with dev's flags, validation and OptimizerConfig, patched."""
    arguments = pytest.importorskip("megatron.training.arguments")
    import megatron.training.training as training

    assert not hooks.is_patched()
    megatron_add = arguments.add_megatron_arguments

    def add_megatron_arguments(parser):
        return add_dev_offloader_flags(megatron_add(parser))

    monkeypatch.setattr(arguments, "add_megatron_arguments", add_megatron_arguments)
    monkeypatch.setattr(arguments, "validate_args", dev_validate_args)
    monkeypatch.setattr(training, "OptimizerConfig", dev_optimizer_config_class())
    unpatched = training.get_megatron_optimizer_config
    hooks.patch_megatron()
    yield arguments, training, unpatched
    hooks.unpatch_megatron()  # before monkeypatch restores Megatron's own


def test_patched_dev_megatron_runs_only_megatron_offload(dev_megatron, printed, attached):
    arguments, training, unpatched = dev_megatron
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(OK_BASE + [PIECE_FLAG, str(64 << 20), "--ckpt-format", "torch"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FutureWarning from the alias
        arguments.validate_args(args)
        config, _ = training.get_megatron_optimizer_config(args)
    assert config.chunked_optimizer_state_offload is False
    assert args.offload_optimizer_states is True  # still megatron-offload's switch

    optimizer = Optimizer(config)
    offloader = hooks.attach_for_training(optimizer, args)
    assert isinstance(offloader, Offloader) and attached[0].max_piece_bytes == 64 << 20
    assert len(printed) == 1  # exactly one line, which says who and why
    line = printed[0]
    assert line.startswith("> optimizer-state offloading: 1 distributed optimizer(s)")
    assert "megatron-offload's offloader is active" in line
    assert f"Megatron's own chunked optimizer-state offloader ({MEGATRON_FLAG}) is off" in line
    assert "selects megatron-offload's offloader" in line and "only one offloader" in line

    # Negative control: Megatron's unwrapped builder turns its own offloader on from the alias,
    # and megatron-offload then refuses to attach a second one.
    with pytest.warns(FutureWarning, match="offload_optimizer_states is deprecated"):
        megatrons_config, _ = unpatched(args)
    assert megatrons_config.chunked_optimizer_state_offload is True
    with pytest.raises(OffloadArgumentError, match="only one may manage"):
        hooks.attach_for_training(Optimizer(megatrons_config), args)
    assert len(attached) == 1 and len(printed) == 1


def test_patched_builder_refuses_a_config_that_enables_megatrons(dev_megatron):
    arguments, training, _ = dev_megatron
    # validate_args would have refused this; the builder refuses it all the same.
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = map_dtypes(parser.parse_args(OK_BASE + [MEGATRON_FLAG]))
    with pytest.raises(OffloadArgumentError) as error:
        training.get_megatron_optimizer_config(args)
    assert OFFLOAD_FLAG in str(error.value) and MEGATRON_FLAG in str(error.value)
    assert args.offload_optimizer_states is True  # restored after the call
    args.offload_optimizer_states = False  # Megatron's alone: built as Megatron builds it
    config, _ = training.get_megatron_optimizer_config(args)
    assert config.chunked_optimizer_state_offload is True


# --------------------------------------------------------------- attach and the log line
def test_attach_refuses_an_optimizer_megatrons_offloader_manages(printed, attached):
    args = argparse.Namespace(offload_optimizer_states=True)
    with pytest.raises(OffloadArgumentError) as error:
        hooks.attach_for_training(Optimizer(megatron_offloader=object()), args)
    assert OFFLOAD_FLAG in str(error.value) and MEGATRON_FLAG in str(error.value)
    config = argparse.Namespace(
        chunked_optimizer_state_offload=True, optimizer_state_offload_fraction=0.0
    )  # dev: fraction 0 is off
    assert hooks.attach_for_training(Optimizer(config), args) is not None
    assert len(attached) == 1


def test_line_is_unchanged_without_an_offloader_of_megatrons(printed, attached):
    hooks.attach_for_training(
        Optimizer(argparse.Namespace(clip_grad=1.0)),
        argparse.Namespace(offload_optimizer_states=True),
    )
    assert printed == [
        "> optimizer-state offloading: 1 distributed optimizer(s); states are "
        "kept in host memory between optimizer steps"
    ]


def test_setup_says_when_megatrons_offloader_is_the_active_one(monkeypatch, printed, attached):
    args = argparse.Namespace(offload_optimizer_states=False)
    monkeypatch.setattr(hooks, "_get_args", lambda: args)
    on = argparse.Namespace(
        chunked_optimizer_state_offload=True, optimizer_state_offload_fraction=1.0
    )
    off = argparse.Namespace(chunked_optimizer_state_offload=False)
    for config in (on, off):
        setup = hooks._wrap_setup_model_and_optimizer(
            lambda config=config: ("model", Optimizer(config), "scheduler")
        )
        assert setup()[0] == "model"
    assert printed == [coexistence.MEGATRON_ACTIVE_LINE] and attached == []
    assert MEGATRON_FLAG in printed[0] and f"no {OFFLOAD_FLAG}" in printed[0]


@pytest.mark.parametrize("how", ["offloader object", "config"])
def test_direct_attach_refuses_an_optimizer_megatrons_offloader_manages(how):
    """attach() / OptimizerStateOffloader(...) without the pretrain flags: the same refusal,
    before anything is touched."""
    from megatron_offload.offloader.members import refuse_unsupported

    if how == "offloader object":
        managed = argparse.Namespace(_optimizer_state_offloader=object(), config=None)
    else:
        managed = argparse.Namespace(
            config=argparse.Namespace(
                chunked_optimizer_state_offload=True, optimizer_state_offload_fraction=0.5
            )
        )
    with pytest.raises(ValueError, match="Megatron's own chunked optimizer-state offloader"):
        refuse_unsupported(managed)
    # Megatron's option present but off (dev's fraction 0 disables it): nothing refused.
    refuse_unsupported(
        argparse.Namespace(
            config=argparse.Namespace(
                chunked_optimizer_state_offload=True, optimizer_state_offload_fraction=0.0
            )
        )
    )
    refuse_unsupported(
        argparse.Namespace(config=argparse.Namespace(chunked_optimizer_state_offload=False))
    )
