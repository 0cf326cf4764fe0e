"""The installed megatron-core copied and patched imports, with and without megatron_offload."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.unit.patches.tree import (
    REPO,
    if_installed_line_has_a_set,
    installed_version,
    matching_set,
    patched_tree,
)

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

    # The patched OptimizerConfig's fields carry the flags' names: its offload_* fields reach
    # the offloader's config as the flags do (get_megatron_optimizer attaches from it).
    from megatron_offload.megatron.arguments import config_from_args
    patched = optimizer.OptimizerConfig(
        offload_optimizer_states=True, offload_chunked_update_bytes=1 << 18,
        offload_max_piece_bytes=1 << 20, offload_release_master_grads=False)
    config = config_from_args(patched)
    assert config.chunked_update_bytes == 1 << 18 and config.max_piece_bytes == 1 << 20
    assert config.release_master_grads is False and config.offload_master_weights is True
    masters = config_from_args(optimizer.OptimizerConfig(offload_master_weights=True))
    assert masters.kinds() == ('master_weights',)

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

    # 5. The state-access contract holds for the patched optimizer package too.
    assert optimizer.__file__.startswith(sys.argv[1]), optimizer.__file__
    from tests.harness.state_contract import unclassified
    assert unclassified() == {}, unclassified()
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
        [sys.executable, "-c", _IMPORT_CHECK, str(tree)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "PATCHED TREE OK" in result.stdout, (
        result.stdout[-3000:] + result.stderr[-5000:]
    )
