"""--offload-optimizer-states and the other flags on Megatron's own argument parser: every
field of OffloadConfig is a flag named as the field, in its unit; and every combination
validate_args refuses (each message names the flags and says what to do)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import pytest

from megatron_offload.config import NOT_FLAGS, OffloadConfig, flag
from megatron_offload.megatron.arguments import (
    CHUNKED_FLAG,
    LOG_FLAG,
    MASTERS_FLAG,
    SWITCH,
    OffloadArgumentError,
    add_arguments,
    config_from_args,
    dest,
    validate_args,
)

OFFLOAD_FLAG = SWITCH
PIECE_FLAG = flag("max_piece_bytes")
UNDO_FLAG = flag("chunked_update_undo")
OK_BASE = [OFFLOAD_FLAG, "--use-distributed-optimizer", "--bf16"]
HAVE_EMERGING = importlib.util.find_spec("emerging_optimizers") is not None
EMERGING_REASON = (
    "needs the emerging-optimizers package (requirements/py312.txt: emerging-optimizers==0.3.0)"
)
FIELDS = [f.name for f in dataclasses.fields(OffloadConfig) if f.name not in NOT_FLAGS]


@pytest.fixture(scope="module")
def megatron_parser():
    """Megatron's full parser (megatron.training.arguments) plus this project's flags."""
    arguments = pytest.importorskip("megatron.training.arguments")
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return add_arguments(parser)


def _parse(parser, argv):
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------- the flags
def test_every_field_is_a_flag_named_as_the_field():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    assert add_arguments(parser) is parser
    assert add_arguments(parser) is parser  # twice on one parser: no argparse conflict
    args = parser.parse_args([])
    assert args.offload_optimizer_states is False
    for name in FIELDS:
        option = flag(name)
        # The field's name with --offload- in front (not twice), lower-case and hyphenated.
        assert option == "--" + ("" if name.startswith("offload_") else "offload-") + name.replace(
            "_", "-"
        )
        action = parser._option_string_actions[option]
        assert action.help and len(action.help) > 40, option
        assert action.dest == dest(name) == option[2:].replace("-", "_")
        if name not in ("offload_optimizer_states", "chunked_update_undo", "require_pinned_memory"):
            assert getattr(args, dest(name)) is None  # not given: the field's default
    assert parser._option_string_actions[LOG_FLAG].dest == "offload_log_stats"
    assert flag("offload_fraction") == "--offload-fraction"
    assert flag("release_master_grads") == "--offload-release-master-grads"
    assert PIECE_FLAG == "--offload-max-piece-bytes"  # bytes, as the field


# Per field: the flag given with a value other than the default, and the value the config gets.
GIVEN = {
    "offload_optimizer_states": ([], True),
    "offload_master_weights": (["--no-offload-master-weights"], False),
    "release_master_grads": (["--no-offload-release-master-grads"], False),
    "offload_fraction": (["--offload-fraction", "0.5"], 0.5),
    "host_memory_budget": (["--offload-host-memory-budget", "auto"], "auto"),
    "prefetch": (["--offload-prefetch", "0.25"], 0.25),
    "offload_disk_dir": (
        ["--offload-disk-dir", "/nvme/offload", "--offload-host-memory-budget", "1000"],
        "/nvme/offload",
    ),
    "chunked_update_bytes": ([CHUNKED_FLAG, "4096"], 4096),
    "chunked_update_slots": (["--offload-chunked-update-slots", "3"], 3),
    "chunked_update_undo": ([UNDO_FLAG, CHUNKED_FLAG, "4096"], True),
    "max_piece_bytes": ([PIECE_FLAG, "1048576"], 1 << 20),
    "stream_priority": (["--offload-stream-priority", "-1"], -1),
    "require_pinned_memory": (["--offload-require-pinned-memory"], True),
    "per_optimizer": (
        ["--offload-per-optimizer", '{"1": {"offload_master_weights": false}}'],
        {1: {"offload_master_weights": False}},
    ),
}


@pytest.mark.parametrize("name", sorted(GIVEN))
def test_config_from_args_maps_every_field(name):
    """Each flag given with a value other than the default reaches its field, in its unit."""
    assert set(GIVEN) == set(FIELDS)  # every field has a flag
    parser = add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    tokens, value = GIVEN[name]
    config = config_from_args(parser.parse_args([OFFLOAD_FLAG] + tokens))
    assert getattr(config, name) == value
    if tokens:  # the switch alone is the field's default
        assert getattr(OffloadConfig(), name) != value  # the flag changed something


def test_the_master_weights_follow_the_switch():
    assert config_from_args(argparse.Namespace(offload_optimizer_states=True)).kinds() == (
        "optimizer_states",
        "master_weights",
    )
    masters = argparse.Namespace(offload_master_weights=True)  # the flag alone: only them
    assert config_from_args(masters).kinds() == ("master_weights",)
    assert config_from_args(argparse.Namespace()).kinds() == ()


def test_flags_coexist_with_megatrons(megatron_parser):
    args = _parse(
        megatron_parser, OK_BASE + ["--no-offload-master-weights", "--offload-prefetch", "step"]
    )
    assert args.offload_optimizer_states and args.offload_master_weights is False
    assert args.offload_prefetch == "step" and args.offload_log_stats is None
    validate_args(args)


def test_max_piece_bytes_option_is_validated_before_anything_is_touched():
    import megatron_offload

    for bad in (0, -1, 1.5, True, "256MiB", None):
        with pytest.raises(ValueError, match="max_piece_bytes .* must be a positive number"):
            OffloadConfig(max_piece_bytes=bad)
        # attach() validates its options before it looks at the optimizer at all.
        with pytest.raises(ValueError, match="max_piece_bytes"):
            megatron_offload.attach(object(), max_piece_bytes=bad)
    assert OffloadConfig(max_piece_bytes=1).max_piece_bytes == 1


# ---------------------------------------------------------------------------- accepted runs
@pytest.mark.parametrize(
    "argv",
    [
        [],  # no flag at all: nothing to check
        ["--use-distributed-optimizer"],
        OK_BASE,
        [OFFLOAD_FLAG, "--use-distributed-optimizer"],  # fp32: moments only
        OK_BASE + ["--fp16"],
        ["--use-distributed-optimizer", "--bf16", MASTERS_FLAG],  # master weights only
        OK_BASE + ["--no-offload-master-weights", "--qk-clip"],
        [OFFLOAD_FLAG, "--use-distributed-optimizer", "--qk-clip"],  # fp32: no master weights
        OK_BASE + ["--cuda-graph-impl", "full_iteration", "--offload-prefetch", "step"],
        OK_BASE + ["--cuda-graph-impl", "local"],
        OK_BASE + ["--overlap-grad-reduce", "--overlap-param-gather"],
        OK_BASE + ["--use-precision-aware-optimizer"],
        OK_BASE + [CHUNKED_FLAG, "1073741824"],
        OK_BASE + [CHUNKED_FLAG, "1073741824", "--no-offload-master-weights"],
        OK_BASE + [CHUNKED_FLAG, "1073741824", "--offload-chunked-update-undo"],
        OK_BASE + [PIECE_FLAG, "67108864"],
        OK_BASE + ["--offload-prefetch", "0.5", "--offload-fraction", "0.5"],
        # megatron-core's offload_to_cpu/restore_from_cpu are routed to the offloader.
        OK_BASE + ["--rl-offload-optimizer-during-inference"],
        [
            "--use-distributed-optimizer",
            "--optimizer-cpu-offload",
        ],  # theirs alone is not ours to judge
        # Without the distributed optimizer: Float16OptimizerWithFloat16Params / FP32Optimizer.
        [OFFLOAD_FLAG, "--bf16"],
        [OFFLOAD_FLAG],
        ["--bf16", MASTERS_FLAG],
        # sgd: with --use-distributed-optimizer megatron-core refuses it itself, at build.
        OK_BASE + ["--optimizer", "sgd"],
        [OFFLOAD_FLAG, "--bf16", "--optimizer", "sgd"],
        # Megatron-FSDP: every sharding strategy is served.
        OK_BASE + ["--use-megatron-fsdp"],
        [OFFLOAD_FLAG, "--bf16", "--use-megatron-fsdp"],  # FSDP switches the dist-opt on
        *(
            OK_BASE + ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]
            for strategy in ("optim_grads_params", "optim_grads", "optim", "no_shard")
        ),
        # Hybrid sharding (HSDP, and HFSDP with a sharded outer group).
        OK_BASE + ["--use-megatron-fsdp", "--num-distributed-optimizer-instances", "2"],
        OK_BASE
        + [
            "--use-megatron-fsdp",
            "--num-distributed-optimizer-instances",
            "2",
            "--outer-dp-sharding-strategy",
            "optim",
        ],
        # The chunked update streams the state shards.
        OK_BASE + ["--use-megatron-fsdp", CHUNKED_FLAG, "4096"],
    ],
    ids=lambda argv: " ".join(argv) or "no-flags",
)
def test_accepted(megatron_parser, argv):
    validate_args(_parse(megatron_parser, argv))


@pytest.mark.skipif(not HAVE_EMERGING, reason=EMERGING_REASON)
@pytest.mark.parametrize(
    "argv",
    [OK_BASE + ["--optimizer", name] for name in ("muon", "dist_muon", "lion", "soap")]
    + [[OFFLOAD_FLAG, "--bf16", "--optimizer", name] for name in ("muon", "lion", "soap")],
    ids=lambda argv: " ".join(argv),
)
def test_emerging_optimizers_accepted(megatron_parser, argv):
    validate_args(_parse(megatron_parser, argv))


@pytest.mark.skipif(not HAVE_EMERGING, reason=EMERGING_REASON)
def test_supported_optimizers_are_exactly_what_megatron_core_builds():
    """megatron-core 0.19.2 with emerging-optimizers 0.3.0: every --optimizer choice but
    adaptive_muon, whose first step fails (TensorParallelAdaptiveMuon has no scale_mode)."""
    from importlib.metadata import version

    from megatron_offload.megatron.arguments import supported_optimizers

    if not version("megatron-core").startswith("0.19."):
        pytest.skip(
            f"pins megatron-core 0.19's set; this is megatron-core {version('megatron-core')}"
        )
    assert supported_optimizers() == ("adam", "sgd", "muon", "dist_muon", "lion", "soap")


def test_emerging_optimizer_without_the_package_is_refused_with_the_reason(
    megatron_parser, monkeypatch
):
    from megatron.core.optimizer import emerging_optimizers

    monkeypatch.setattr(emerging_optimizers, "HAVE_EMERGING_OPTIMIZERS", False)
    args = _parse(megatron_parser, OK_BASE + ["--optimizer", "lion"])
    with pytest.raises(OffloadArgumentError) as raised:
        validate_args(args)
    message = str(raised.value)
    assert "pip install emerging-optimizers" in message and "are: adam, sgd." in message


# ---------------------------------------------------------------------------- refused runs
REFUSED = [
    pytest.param(
        OK_BASE + ["--optimizer-cpu-offload"],
        [
            OFFLOAD_FLAG,
            "--optimizer-cpu-offload",
            "mutually exclusive",
            "runs Adam on the CPU",
            "Drop --optimizer-cpu-offload",
        ],
        id="optimizer-cpu-offload",
    ),
    pytest.param(
        OK_BASE + ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"],
        [OFFLOAD_FLAG, "--optimizer-cpu-offload", "mutually exclusive"],
        id="optimizer-cpu-offload-precision-aware",
    ),
    pytest.param(
        OK_BASE + ["--optimizer", "adaptive_muon"],
        [
            OFFLOAD_FLAG,
            "--optimizer adaptive_muon",
            "no attribute 'scale_mode'",
            "adam, sgd, muon, dist_muon, lion, soap",
            "drop " + OFFLOAD_FLAG,
        ],
        id="adaptive-muon",
        marks=pytest.mark.skipif(not HAVE_EMERGING, reason=EMERGING_REASON),
    ),
    pytest.param(
        [OFFLOAD_FLAG, "--bf16", "--use-torch-fsdp2"],
        [OFFLOAD_FLAG, "--use-torch-fsdp2", "Drop --use-torch-fsdp2"],
        id="torch-fsdp2",
    ),
    pytest.param(
        OK_BASE + ["--optimizer-cuda-graph"],
        [
            OFFLOAD_FLAG,
            "--optimizer-cuda-graph",
            "fixed device addresses",
            "Drop --optimizer-cuda-graph",
        ],
        id="optimizer-cuda-graph",
    ),
    pytest.param(
        OK_BASE + ["--cuda-graph-impl", "full_iteration"],
        [OFFLOAD_FLAG, "--cuda-graph-impl full_iteration", "Add --offload-prefetch step"],
        id="full-iteration-cuda-graph",
    ),
    pytest.param(
        OK_BASE + ["--enable-cuda-graph", "--cuda-graph-scope", "full_iteration"],
        [OFFLOAD_FLAG, "--cuda-graph-impl full_iteration", "--offload-prefetch step"],
        id="deprecated-full-iteration-cuda-graph",
    ),
    pytest.param(
        OK_BASE + ["--qk-clip"],
        [OFFLOAD_FLAG, "--qk-clip", "master weights", "Add --no-offload-master-weights"],
        id="qk-clip",
    ),
    pytest.param(
        OK_BASE
        + [
            "--reuse-grad-buf-for-mxfp8-param-ag",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ],
        [
            OFFLOAD_FLAG,
            "--reuse-grad-buf-for-mxfp8-param-ag",
            "--overlap-param-gather",
            "Add --no-offload-master-weights",
        ],
        id="mxfp8-param-buffer-reuse",
    ),
    pytest.param(
        OK_BASE + ["--freeze-all-layers"],
        [OFFLOAD_FLAG, "--freeze-all-layers", "Drop one"],
        id="freeze-all-layers",
    ),
    pytest.param(
        ["--use-distributed-optimizer", MASTERS_FLAG],
        [MASTERS_FLAG, OFFLOAD_FLAG, "--bf16 or --fp16"],
        id="master-weights-only-in-fp32",
    ),
    pytest.param(
        ["--use-distributed-optimizer", "--offload-prefetch", "step"],
        ["--offload-prefetch has no effect without " + OFFLOAD_FLAG, "add " + OFFLOAD_FLAG],
        id="tuning-flag-without-offloading",
    ),
    pytest.param(
        ["--use-distributed-optimizer", CHUNKED_FLAG, "4096"],
        [CHUNKED_FLAG + " has no effect without " + OFFLOAD_FLAG],
        id="chunked-update-without-offloading",
    ),
    pytest.param(
        OK_BASE + [CHUNKED_FLAG, "0"],
        [CHUNKED_FLAG, "must be a number of bytes (int > 0)"],
        id="chunked-update-zero-bytes",
    ),
    pytest.param(
        ["--bf16", MASTERS_FLAG, CHUNKED_FLAG, "4096"],
        [CHUNKED_FLAG, "optimizer states", "Add " + OFFLOAD_FLAG],
        id="chunked-update-without-optimizer-states",
    ),
    pytest.param(
        OK_BASE + ["--offload-chunked-update-undo"],
        [UNDO_FLAG, "has no effect without", CHUNKED_FLAG],
        id="chunked-undo-flag-without-chunked-update",
    ),
    pytest.param(
        ["--use-distributed-optimizer", PIECE_FLAG, "64"],
        [PIECE_FLAG + " has no effect without " + OFFLOAD_FLAG],
        id="max-piece-without-offloading",
    ),
    pytest.param(
        OK_BASE + [PIECE_FLAG, "0"],
        [PIECE_FLAG, "must be a positive number of bytes"],
        id="max-piece-zero",
    ),
    pytest.param(
        OK_BASE + [PIECE_FLAG, "-8"],
        [PIECE_FLAG, "must be a positive number of bytes"],
        id="max-piece-negative",
    ),
    pytest.param(
        OK_BASE + ["--offload-fraction", "1.5"],
        ["--offload-fraction", "from 0 to 1"],
        id="fraction-above-one",
    ),
    pytest.param(
        OK_BASE + ["--offload-fraction", "0.5", CHUNKED_FLAG, "4096"],
        [CHUNKED_FLAG, "--offload-fraction", "Use one of them"],
        id="fraction-with-chunked-update",
    ),
    pytest.param(
        ["--no-offload-log-stats", "--no-offload-master-weights"],
        ["--no-offload-master-weights", "--no-offload-log-stats", OFFLOAD_FLAG],
        id="tuning-flags-without-offloading",
    ),
]


@pytest.mark.parametrize("argv, expected", REFUSED)
def test_refused(megatron_parser, argv, expected):
    args = _parse(megatron_parser, argv)
    with pytest.raises(OffloadArgumentError) as error:
        validate_args(args)
    message = str(error.value)
    for text in expected:
        assert text in message, f"{text!r} not in: {message}"
    assert isinstance(error.value, ValueError)


def test_accepted_after_megatron_derived_it():
    """validate_args also runs on the namespace Megatron's validate_args produced: Megatron
    turns the distributed optimizer off (and the layer-wise one on) for emerging optimizers;
    both are served."""
    derived = argparse.Namespace(
        offload_optimizer_states=True,
        use_distributed_optimizer=False,
        use_layer_wise_distributed_optimizer=True,
        optimizer="adam",
        bf16=True,
    )
    validate_args(derived)
    derived.freeze_all_layers = True  # turns the optimizer off: nothing to offload
    with pytest.raises(OffloadArgumentError, match="--freeze-all-layers"):
        validate_args(derived)


def test_namespace_from_another_parser_is_read_with_defaults():
    validate_args(argparse.Namespace())
    validate_args(argparse.Namespace(offload_optimizer_states=False))
    validate_args(argparse.Namespace(offload_optimizer_states=True, use_distributed_optimizer=True))


@pytest.mark.parametrize(
    "text, error",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "a JSON object"),
        ('{"experts": {}}', "optimizer indices"),
    ],
)
def test_per_optimizer_flag_is_parsed_with_a_clear_error(text, error):
    parser = add_arguments(argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False))
    with pytest.raises(argparse.ArgumentError, match=error):
        parser.parse_args([OFFLOAD_FLAG, "--offload-per-optimizer", text])


def test_budget_and_prefetch_flags_take_their_words_and_numbers():
    parser = add_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(
        [OFFLOAD_FLAG, "--offload-host-memory-budget", "4096", "--offload-prefetch", "step"]
    )
    assert config_from_args(args).host_memory_budget == 4096
    assert config_from_args(args).prefetch == "step"
