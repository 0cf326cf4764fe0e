"""Build ``guard_pages.c`` (a preloadable allocator that makes every freed tensor storage
inaccessible, so a late reader or writer faults where it happens) and the environment that
preloads it into a process and its children.

A late write into freed memory corrupts whatever reused it, or glibc's heap (``malloc():
unaligned tcache chunk detected``), rarely and far from the writer; under these guard pages
the same write is a segmentation fault at the writer, every time it happens. Linux only; needs
a C compiler (``cc``)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("guard_pages.c")


def build(directory: str | os.PathLike) -> Path:
    """Compile the allocator into ``directory``; returns the shared library's path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("guard_pages needs a C compiler (cc or gcc) on PATH")
    library = Path(directory) / "guard_pages.so"
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(SOURCE), "-ldl"],
        check=True,
        capture_output=True,
    )
    return library


def environment(library: str | os.PathLike, base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) with the allocator preloaded and Python's
    fault handler on (a fault prints the Python stack of the faulting thread)."""
    env = dict(os.environ if base is None else base)
    preload = env.get("LD_PRELOAD")
    env["LD_PRELOAD"] = str(library) + (f":{preload}" if preload else "")
    env["PYTHONFAULTHANDLER"] = "1"
    return env
