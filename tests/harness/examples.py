"""The examples under ``examples/`` loaded as modules, for tests that call their functions."""

from __future__ import annotations

import argparse
import importlib.util
import os

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def load_example(relative_path: str, name: str | None = None):
    """``examples/<relative_path>`` as a fresh module (``name``: its module name, by default the
    file's)."""
    path = os.path.join(EXAMPLES, relative_path)
    name = name or os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_plain_and_offloaded(relative_path: str, **args):
    """The example's ``train(args, offload=...)`` without and with offloading:
    ``(plain results, offloaded results, the offloaded run's stats)``."""
    example = load_example(relative_path)
    namespace = argparse.Namespace(**args)
    plain, _ = example.train(namespace, offload=False)
    offloaded, stats = example.train(namespace, offload=True)
    return plain, offloaded, stats
