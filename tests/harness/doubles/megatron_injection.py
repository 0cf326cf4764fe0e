"""Make megatron-core use a test double of TE's or apex's FusedAdam, for one ``with`` block.

megatron-core decides which Adam it uses once, when ``megatron.core.optimizer`` is imported
(``try: from transformer_engine.pytorch.optimizers import FusedAdam as Adam ... except ImportError:
try apex ... else torch.optim.AdamW``), and records the outcome in module globals that are read
again at call time. The rank processes import megatron-core at start-up, long before a job runs,
so the least invasive injection is to set those globals to what the import would have produced
had the package been installed, and to put them back afterwards:

``megatron.core.optimizer`` (``__init__.py``; checked in 0.19.2 and 0.16.1)
    ``Adam`` (the class ``get_megatron_optimizer`` instantiates) and ``USING_PYTORCH_OPTIMIZER``
    (False: pass ``adam_w_mode`` instead of choosing torch's Adam/AdamW);
    ``is_te_min_version`` (``_get_megatron_optimizer_based_on_param_groups`` passes
    ``store_param_remainders`` only if TE >= 2.1.0.dev0).
``megatron.core.optimizer.distrib_optimizer``
    ``Adam`` (the isinstance check in ``DistributedOptimizer.__init__``), ``USING_TE_OPTIMIZER``
    / ``USING_APEX_OPTIMIZER`` / ``HAVE_APEX_OR_TE`` (how ``state_dict``/``load_state_dict`` find
    the step: per group for TE and apex, per parameter for torch).
``megatron.core.optimizer.optimizer_config`` (TE only)
    ``is_te_min_version`` (``OptimizerConfig.__post_init__`` turns ``store_param_remainders`` off
    below TE 2.1.0), and ``OptimizerConfig.__post_init__`` itself, wrapped so that during that
    call only ``from transformer_engine.pytorch.optimizers import FusedAdam`` finds a minimal
    ``transformer_engine`` package (``__version__`` = ``TE_VERSION``) exposing the double: the
    precision-aware check inspects that class's signature. The fake package is in
    ``sys.modules`` only for the duration of that call, so no other megatron-core module ever
    sees a "Transformer Engine" that it would try to use (fp8_utils, extensions, ...), and
    ``megatron.core.utils``'s cached TE version is never touched.

Nothing is re-imported, no file is changed, and every patched attribute is restored on exit even
if the block raises. If a patched name is missing (a megatron-core version that decides
differently), the context manager raises instead of silently training with torch's AdamW.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types

from . import apex_fused_adam, te_fused_adam

__all__ = ["apex_fused_adam_injected", "te_fused_adam_injected", "TE_VERSION"]

TE_VERSION = te_fused_adam.TE_VERSION
_MISSING = object()


def _version_at_least(have: str, want: str, check_equality: bool = True) -> bool:
    from packaging.version import Version

    return Version(have) >= Version(want) if check_equality else Version(have) > Version(want)


@contextlib.contextmanager
def _patched(patches):
    """Set ``(owner, name, value)`` attributes, all of which must exist; restore them on exit."""
    saved = []
    try:
        for owner, name, value in patches:
            previous = getattr(owner, name, _MISSING)
            if previous is _MISSING:
                raise RuntimeError(
                    f"{getattr(owner, '__name__', owner)}.{name} does not exist: this megatron-core "
                    "version chooses its Adam differently; update tests/harness/doubles/megatron_injection.py"
                )
            saved.append((owner, name, previous))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, previous in reversed(saved):
            setattr(owner, name, previous)


@contextlib.contextmanager
def _fake_transformer_engine(version: str):
    """A minimal importable ``transformer_engine.pytorch.optimizers`` for the block's duration."""
    names = (
        "transformer_engine",
        "transformer_engine.pytorch",
        "transformer_engine.pytorch.optimizers",
    )
    if any(name in sys.modules for name in names) or importlib.util.find_spec("transformer_engine"):
        yield  # the real package is importable: its own check is as good as ours
        return
    root = types.ModuleType("transformer_engine")
    root.__version__ = version
    root.__path__ = []  # a package
    root.__doc__ = "Test double (tests/harness/doubles): not Transformer Engine."
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.__path__ = []
    optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    optimizers.FusedAdam = te_fused_adam.FusedAdam
    optimizers.FusedSGD = te_fused_adam.FusedSGD
    root.pytorch = pytorch
    pytorch.optimizers = optimizers
    modules = dict(zip(names, (root, pytorch, optimizers)))
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in modules.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def _common_patches(adam_cls, *, te: bool, apex: bool):
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.distrib_optimizer as mcore_distrib

    return [
        (mcore_optimizer, "Adam", adam_cls),
        (mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False),
        (mcore_distrib, "Adam", adam_cls),
        (mcore_distrib, "USING_TE_OPTIMIZER", te),
        (mcore_distrib, "USING_APEX_OPTIMIZER", apex),
        (mcore_distrib, "HAVE_APEX_OR_TE", True),
    ]


@contextlib.contextmanager
def te_fused_adam_injected(version: str = TE_VERSION):
    """Inside the block, megatron-core builds and drives the TE FusedAdam double.

    ``OptimizerConfig(use_precision_aware_optimizer=True, ...)`` passes its TE checks and
    ``get_megatron_optimizer`` returns a DistributedOptimizer around
    ``tests.harness.doubles.te_fused_adam.FusedAdam`` (with master weights in its state, decoupled
    gradients, remainders and low-precision moments as configured).
    """
    import megatron.core.optimizer as mcore_optimizer
    import megatron.core.optimizer.optimizer_config as mcore_config

    config_cls = mcore_config.OptimizerConfig
    original_post_init = config_cls.__post_init__

    @functools.wraps(original_post_init)
    def post_init(self):
        with _fake_transformer_engine(version):
            original_post_init(self)

    min_version = functools.partial(_version_at_least, version)

    def is_te_min_version(wanted, check_equality=True):
        return min_version(wanted, check_equality)

    patches = _common_patches(te_fused_adam.FusedAdam, te=True, apex=False) + [
        (mcore_optimizer, "is_te_min_version", is_te_min_version),
        (mcore_config, "is_te_min_version", is_te_min_version),
        (config_cls, "__post_init__", post_init),
    ]
    with _patched(patches):
        yield te_fused_adam


@contextlib.contextmanager
def apex_fused_adam_injected():
    """Inside the block, megatron-core builds and drives the apex FusedAdam double."""
    with _patched(_common_patches(apex_fused_adam.FusedAdam, te=False, apex=True)):
        yield apex_fused_adam
