"""Each file in patches/ applies cleanly to the files it targets as shipped in the installed
megatron-core wheel, and the patched tree imports and has the flag, validation and hooks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.unit.patches.tree import (
    REPO,
    apply,
    installed_megatron,
    installed_version,
    matching_set,
    patch_sets,
    patched_tree,
)

ALL_PATCHES = [
    pytest.param(patch_set, patch, id=f'{patch_set.name}/{patch.path.name}')
    for patch_set in patch_sets()
    for patch in patch_set.patches
]


def test_patches_exist_for_training_and_core_optimizer():
    sets = {patch_set.name: patch_set for patch_set in patch_sets()}
    assert 'megatron-core-0.19' in sets
    targets = {t for patch in sets['megatron-core-0.19'].patches for t in patch.targets}
    assert {
        'megatron/training/arguments.py',
        'megatron/training/training.py',
        'megatron/core/optimizer/__init__.py',
        'megatron/core/optimizer/optimizer_config.py',
    } <= targets


@pytest.mark.parametrize('patch_set, patch', ALL_PATCHES)
def test_patch_applies_cleanly_to_the_wheel_files(patch_set, patch, tmp_path):
    version = installed_version()
    if not (version == patch_set.version or version.startswith(patch_set.version + '.')):
        pytest.skip(f'{patch_set.name} targets megatron-core {patch_set.version}.x; '
                    f'megatron-core {version} is installed')
    site = installed_megatron()
    for target in patch.targets:
        (tmp_path / target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(site / target, tmp_path / target)
    # git apply allows no fuzz at all; patch --fuzz=0 must not even need an offset.
    check = subprocess.run(['git', 'apply', '--check', '-p1', str(patch.path)], cwd=tmp_path,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    dry = apply(patch.path, tmp_path, check=True)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert 'offset' not in dry.stdout and 'fuzz' not in dry.stdout, dry.stdout
    assert apply(patch.path, tmp_path, check=False).returncode == 0
    # Applied once, the tree refuses the same patch again (it is not silently re-applied).
    assert apply(patch.path, tmp_path, check=True).returncode != 0


_IMPORT_CHECK = textwrap.dedent('''
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
    assert {'offload_optimizer_states', 'offload_moments', 'offload_master_weights',
            'offload_release_master_grads'} <= fields, fields
    assert optimizer.OptimizerConfig().offload_optimizer_states is False
    assert callable(optimizer._build_megatron_optimizer)
    assert callable(training._optimizer_state_offload_residency)

    # 2. With it: the flags exist and validate_args refuses before Megatron's own checks.
    del sys.modules['megatron_offload']
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    for flag in ('--offload-optimizer-states', '--no-offload-master-weights',
                 '--no-offload-prefetch'):
        assert parser._option_string_actions[flag].help, flag
    args = parser.parse_args(['--offload-optimizer-states', '--optimizer-cpu-offload'])
    from megatron_offload.integration.arguments import OffloadArgumentError
    try:
        arguments.validate_args(args)
    except OffloadArgumentError as error:
        assert '--optimizer-cpu-offload' in str(error), error
    else:
        raise AssertionError('the patched validate_args accepted --optimizer-cpu-offload')

    # 3. patch_megatron() leaves a patched tree alone.
    from megatron_offload.integration import training as offload_training
    before = training.train
    offload_training.patch_megatron()
    assert training.train is before and not offload_training.is_patched()
    print('PATCHED TREE OK')
''')


def test_patched_tree_imports(tmp_path):
    if matching_set() is None:
        pytest.skip(f'no patch set for megatron-core {installed_version()}')
    tree = patched_tree(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]),
               OMP_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')
    result = subprocess.run([sys.executable, '-c', _IMPORT_CHECK], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and 'PATCHED TREE OK' in result.stdout, (
        result.stdout[-3000:] + result.stderr[-5000:]
    )
