"""Each file in patches/ applies cleanly to the files it targets as shipped in the installed
megatron-core wheel, and the patched tree imports and has the flag, validation and hooks."""

from __future__ import annotations

import collections
import shutil
import subprocess

import pytest

from tests.unit.patches.tree import (
    apply,
    installed_megatron,
    installed_version,
    installed_version_or_none,
    patch_sets,
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
