"""The patches in patches/ and the installed megatron-core files they target.

``patch_sets()`` lists each patch directory (named after the megatron-core line it targets,
e.g. ``megatron-core-0.19``) with its patch files and the files each one changes;
``patched_tree(tmp)`` copies the installed ``megatron`` package (with its bytecode caches, so
imports stay fast) into ``tmp`` and applies every patch of the installed version's set.
Importing this module does not import megatron or torch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PATCHES = REPO / "patches"


@dataclasses.dataclass(frozen=True)
class PatchFile:
    path: Path
    targets: tuple  # repository-relative paths ('megatron/...') the patch changes


@dataclasses.dataclass(frozen=True)
class PatchSet:
    name: str  # 'megatron-core-0.19'
    version: str  # '0.19'
    patches: tuple


def patch_sets() -> list[PatchSet]:
    sets = []
    for directory in sorted(p for p in PATCHES.iterdir() if p.is_dir()):
        match = re.fullmatch(r"megatron-core-(\d+\.\d+)", directory.name)
        if not match:
            continue
        patches = []
        for path in sorted(directory.glob("*.patch")):
            targets = tuple(
                line[len("+++ b/") :].split("\t")[0].strip()
                for line in path.read_text().splitlines()
                if line.startswith("+++ b/")
            )
            patches.append(PatchFile(path, targets))
        sets.append(PatchSet(directory.name, match.group(1), tuple(patches)))
    return sets


def installed_megatron() -> Path:
    """The directory holding the installed ``megatron`` package (site-packages)."""
    spec = importlib.util.find_spec("megatron.core")
    return Path(spec.origin).resolve().parents[2]


def installed_version() -> str:
    """megatron-core's version, read from its package_info without importing it."""
    text = (installed_megatron() / "megatron" / "core" / "package_info.py").read_text()
    values = {k: v for k, v in re.findall(r"^(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", text, re.M)}
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}"


def targets_version(patch_set: PatchSet, version: str) -> bool:
    """Whether ``patch_set`` is the one for megatron-core ``version`` ('0.18' for 0.18.2)."""
    return version == patch_set.version or version.startswith(patch_set.version + ".")


def installed_version_or_none() -> str | None:
    """``installed_version()``, or None where no megatron-core is installed."""
    try:
        return installed_version()
    except (ImportError, AttributeError, OSError):
        return None


def matching_set() -> PatchSet | None:
    version = installed_version()
    for patch_set in patch_sets():
        if targets_version(patch_set, version):
            return patch_set
    return None


def if_installed_line_has_a_set(mark):
    """``mark`` (a decorator) where the installed megatron-core line has a set in patches/,
    no-op elsewhere: ``@if_installed_line_has_a_set(pytest.mark.line)`` runs a test in the
    environment of each line with a set, and leaves it out of 0.17's (which has none)."""
    version = installed_version_or_none()
    if version and any(targets_version(patch_set, version) for patch_set in patch_sets()):
        return mark
    return lambda function: function


def apply(patch: Path, root: Path, *, check: bool) -> subprocess.CompletedProcess:
    """``patch -p1`` without fuzz (``--dry-run`` when ``check``) in ``root``."""
    command = ["patch", "-p1", "--fuzz=0", "--forward", "--batch", "-i", str(patch)]
    if check:
        command.insert(1, "--dry-run")
    return subprocess.run(command, cwd=root, capture_output=True, text=True)


def patched_tree(tmp: Path) -> Path:
    """A copy of the installed megatron package with the matching patch set applied; returns
    the directory to put first on PYTHONPATH."""
    patch_set = matching_set()
    if patch_set is None:
        raise RuntimeError(f"no patch set in patches/ for megatron-core {installed_version()}")
    root = Path(tmp) / "megatron-tree"
    shutil.copytree(installed_megatron() / "megatron", root / "megatron")
    for patch in patch_set.patches:
        result = apply(patch.path, root, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{patch.path.name} does not apply:\n{result.stdout}{result.stderr}")
    return root
