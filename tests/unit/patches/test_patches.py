"""Each file in patches/ applies cleanly to the files it targets as shipped in the installed
megatron-core wheel, and the patched tree imports and has the flag, validation and hooks."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.unit.patches.tree import (
    REPO,
    apply,
    if_installed_line_has_a_set,
    installed_megatron,
    installed_version,
    installed_version_or_none,
    matching_set,
    patch_sets,
    patched_tree,
    targets_version,
)

_INSTALLED = installed_version_or_none()
# The set of the installed megatron-core line also runs in that line's environment (marker
# ``line``); the other sets' cases are skipped wherever they run, so they carry no marker.
ALL_PATCHES = [
    pytest.param(
        patch_set,
        patch,
        id=f"{patch_set.name}/{patch.path.name}",
        marks=[pytest.mark.line] if _INSTALLED and targets_version(patch_set, _INSTALLED) else [],
    )
    for patch_set in patch_sets()
    for patch in patch_set.patches
]
# Each megatron-core line with a patch set (core_r0.18.x and core_r0.19.x), and what each
# patch of every set must change.
LINES = ("0.18", "0.19")
TARGETS = {
    "megatron-training.patch": ("megatron/training/arguments.py", "megatron/training/training.py"),
    "megatron-core-optimizer.patch": (
        "megatron/core/optimizer/optimizer_config.py",
        "megatron/core/optimizer/__init__.py",
    ),
}


def _added_lines(patch) -> list:
    return [
        line[1:]
        for line in patch.path.read_text().splitlines()
        if line.startswith("+") and not line.startswith("+++")
    ]


@pytest.mark.line
def test_patches_exist_for_training_and_core_optimizer():
    sets = {patch_set.name: patch_set for patch_set in patch_sets()}
    for line in LINES:
        name = f"megatron-core-{line}"
        assert name in sets, sorted(sets)
        patches = {patch.path.name: patch.targets for patch in sets[name].patches}
        assert patches == TARGETS, (name, patches)


@pytest.mark.line
def test_patch_sets_add_the_same_hooks():
    """Every set adds the same offload lines (flags, fields, helpers, calls into
    megatron_offload.integration), as often: only where they go differs between the lines."""

    def offload_lines(patch) -> collections.Counter:
        return collections.Counter(
            text.strip() for text in _added_lines(patch) if "offload" in text.lower()
        )

    sets = {patch_set.version: patch_set for patch_set in patch_sets()}
    reference = {patch.path.name: offload_lines(patch) for patch in sets[LINES[-1]].patches}
    assert (
        reference["megatron-training.patch"][
            "from megatron_offload.megatron.training import attach_for_training"
        ]
        == 1
    )
    for line in LINES[:-1]:
        assert {patch.path.name: offload_lines(patch) for patch in sets[line].patches} == reference


@pytest.mark.parametrize("patch_set, patch", ALL_PATCHES)
def test_patch_applies_cleanly_to_the_wheel_files(patch_set, patch, tmp_path):
    version = installed_version()
    if not targets_version(patch_set, version):
        pytest.skip(
            f"{patch_set.name} targets megatron-core {patch_set.version}.x; "
            f"megatron-core {version} is installed"
        )
    site = installed_megatron()
    for target in patch.targets:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / target, tmp_path / target)
    # git apply allows no fuzz at all; patch --fuzz=0 must not even need an offset.
    check = subprocess.run(
        ["git", "apply", "--check", "-p1", str(patch.path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stderr
    dry = apply(patch.path, tmp_path, check=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "offset" not in dry.stdout and "fuzz" not in dry.stdout, dry.stdout
    assert apply(patch.path, tmp_path, check=False).returncode == 0
    # Applied once, the tree refuses the same patch again (it is not silently re-applied).
    assert apply(patch.path, tmp_path, check=True).returncode != 0


_IMPORT_CHECK = textwrap.dedent("""
    import argparse, dataclasses, sys

    # 1. Without the megatron_offload package the patched tree imports and has no new flag.
    sys.modules['megatron_offload'] = None
    import megatron.training.arguments as arguments
    import megatron.training.training as training
    import megatron.core.optimizer as optimizer
    assert arguments._OPTIMIZER_STATE_OFFLOAD_PATCH == 1
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    assert '--offload-optimizer-states' not in parser._option_string_actions
    fields = {f.name for f in dataclasses.fields(optimizer.OptimizerConfig)}
    assert {'offload_optimizer_states', 'offload_master_weights',
            'offload_release_master_grads', 'offload_chunked_update_bytes',
            'offload_max_piece_bytes'} <= fields, fields
    assert optimizer.OptimizerConfig().offload_optimizer_states is False
    assert callable(optimizer._build_megatron_optimizer)
    assert callable(training._optimizer_state_offload_residency)

    # 2. With it: the flags exist and validate_args refuses before Megatron's own checks.
    del sys.modules['megatron_offload']
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for flag in ('--offload-optimizer-states', '--no-offload-master-weights',
                 '--offload-prefetch'):
        assert parser._option_string_actions[flag].help, flag
    args = parser.parse_args(['--offload-optimizer-states', '--optimizer-cpu-offload'])
    from megatron_offload.megatron.arguments import OffloadArgumentError
    try:
        arguments.validate_args(args)
    except OffloadArgumentError as error:
        assert '--optimizer-cpu-offload' in str(error), error
    else:
        raise AssertionError('the patched validate_args accepted --optimizer-cpu-offload')

    # 3. patch_megatron() leaves a patched tree alone.
    from megatron_offload.megatron import training as offload_training
    before = training.train
    offload_training.patch_megatron()
    assert training.train is before and not offload_training.is_patched()

    # 4. Each hook sits in its function, after what it must follow.
    import inspect
    def after(function, hook, anchor):
        source = inspect.getsource(function)
        assert hook in source, (function.__name__, hook)
        assert source.index(hook) > source.rindex(anchor), (function.__name__, hook, anchor)
    after(training.setup_model_and_optimizer, 'attach_for_training(optimizer, args)',
          'get_megatron_optimizer(')
    # train() must not set the finalize hook again after the prefetch wraps it.
    after(training.train, 'install_prefetch(config, optimizer, args)',
          'config.finalize_model_grads_func = ')
    after(training.save_checkpoint_and_time,
          'with _optimizer_state_offload_residency(optimizer, read_only=True):', '# Save checkpoint.')
    after(training.training_log, 'log_for_megatron(iteration)', 'timers.log(timers_to_log')
    after(training.train, 'with _optimizer_state_offload_residency():', 'if args.log_params_norm:')
    print('PATCHED TREE OK')
""")


@if_installed_line_has_a_set(pytest.mark.line)
def test_patched_tree_imports(tmp_path):
    if matching_set() is None:
        pytest.skip(f"no patch set for megatron-core {installed_version()}")
    tree = patched_tree(tmp_path)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]),
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
    )
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "PATCHED TREE OK" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-5000:]
    )
