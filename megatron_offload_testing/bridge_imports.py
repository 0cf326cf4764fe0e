"""Megatron-Bridge 0.6 imported on a CPU machine, with two packages stubbed for it alone.

Installed by ``scripts/venv.sh bridge`` (``requirements/bridge.txt``): Bridge itself without
its dependencies, and those of them its training modules import that run on a CPU
(transformers, datasets, megatron-energon, nvidia-modelopt, tensorboard, omegaconf, ...).
Stubbed, for importers inside ``megatron.bridge`` only (a module-level ``import`` there gets
a stub; megatron-core's own ``try: import transformer_engine`` still fails, so megatron-core
keeps its non-TE code paths):

* ``transformer_engine``: needs a CUDA GPU; Bridge's PEFT and model-conversion modules
  import it unconditionally at module level. Every attribute is a class that does nothing.
* ``nvidia_resiliency_ext``: the registry's wheel (0.4.1) breaks ``import megatron.core``
  0.19.2; Bridge's ``pretrain`` and fault-tolerance modules import it at module level.

``megatron.bridge`` itself is entered without running its ``__init__`` (which registers
every Hugging Face model conversion and needs diffusers, timm and more); its subpackages
import as usual.
"""

from __future__ import annotations

import builtins
import importlib.util
import sys
import types

STUBBED = ("transformer_engine", "nvidia_resiliency_ext")
_stubs: dict[str, types.ModuleType] = {}
_original_import = builtins.__import__


class _StubClass(type):
    """A stub class: its attributes are stub classes, and it decorates as the identity."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return super().__call__()


def _stub_class(name: str) -> type:
    return _StubClass(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _stub_module(name: str) -> types.ModuleType:
    if name not in _stubs:
        module = _StubModule(name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        _stubs[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(_stub_module(parent), child, module)
    return _stubs[name]


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and name.split(".")[0] in STUBBED and importer.startswith("megatron.bridge"):
        module = _stub_module(name)
        for item in fromlist or ():
            getattr(module, item)
        return module if fromlist else _stub_module(name.split(".")[0])
    return _original_import(name, globals, locals, fromlist, level)


def install() -> None:
    """Make ``megatron.bridge.*`` importable here (idempotent)."""
    import megatron.core  # noqa: F401 - first, with no stub in sight

    if "megatron.bridge" not in sys.modules:
        spec = importlib.util.find_spec("megatron.bridge")
        if spec is None:
            raise ImportError(
                "megatron-bridge is not installed: run the suite in scripts/venv.sh bridge"
            )
        package = types.ModuleType("megatron.bridge")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["megatron.bridge"] = package
    builtins.__import__ = _import
