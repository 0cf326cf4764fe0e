"""What ``pip install .`` installs: the package a user runs, without the test machinery."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def test_the_installed_packages_are_megatron_offload_alone():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(REPO), include=include)
    assert project["project"]["name"] == "megatron-offload"
    assert not (REPO / "setup.py").exists()  # the metadata is in one place
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
