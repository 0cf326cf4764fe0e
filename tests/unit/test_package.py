"""What ``pip install .`` installs: the package a user runs, without the test machinery."""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_packages_are_megatron_offload_alone():
    setup = (REPO / "setup.py").read_text()
    include = re.search(r"find_packages\(include=(\[[^\]]*\])\)", setup).group(1)
    packages = find_packages(str(REPO), include=eval(include))  # the list literal in setup.py
    assert "megatron_offload" in packages and "megatron_offload.frameworks" in packages
    assert all(p == "megatron_offload" or p.startswith("megatron_offload.") for p in packages), (
        packages
    )
    assert (REPO / "megatron_offload_testing" / "__init__.py").exists()  # beside it, not in it


def test_the_package_never_imports_the_test_machinery():
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "megatron_offload").rglob("*.py")
        if re.search(
            r"^\s*(from|import)\s+(megatron_offload_testing|tests)\b", path.read_text(), re.M
        )
    ]
    assert offenders == []
