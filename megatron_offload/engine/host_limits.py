"""What the node and the container can give in host memory: read once, before attaching.

Every rank of a node allocates a host arena of its own, so what matters is the sum over the
node's ranks against the smallest of:

* ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping);
* the memory cgroup's limit minus its usage: ``memory.max`` / ``memory.current`` (cgroup v2)
  or ``memory.limit_in_bytes`` / ``memory.usage_in_bytes`` (v1), for the group named in
  ``/proc/self/cgroup`` (or the mount's root, where a container sees its own group there);

and, where host memory is pinned, each process's ``RLIMIT_MEMLOCK`` (``ulimit -l``) against
its own pinned bytes. A limit that cannot be read counts as none.
"""

from __future__ import annotations

import dataclasses
import os

#: Limits at or above this are "no limit" (cgroup v1 writes 2^63 rounded down to a page).
UNLIMITED = 1 << 62


@dataclasses.dataclass(frozen=True)
class HostLimits:
    """Host bytes this process may still take; None where nothing limits it."""

    mem_available: int | None
    cgroup_available: int | None
    cgroup_name: str | None  # "cgroup v2 /sys/fs/cgroup/x" or "cgroup v1 ...": where it came from
    memlock: int | None  # RLIMIT_MEMLOCK of this process (soft), bytes

    @property
    def available(self) -> int | None:
        """The smaller of the node's available memory and the container's room."""
        known = [v for v in (self.mem_available, self.cgroup_available) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        parts = []
        if self.mem_available is not None:
            parts.append(f"MemAvailable {self.mem_available:,} bytes")
        if self.cgroup_available is not None:
            parts.append(f"{self.cgroup_name} room {self.cgroup_available:,} bytes")
        return ", ".join(parts) or "no limit found"


def read(root: str = "/") -> HostLimits:
    """The limits as seen from ``root`` (the file system's root; tests pass a fake tree)."""
    cgroup_available, cgroup_name = _cgroup(root)
    return HostLimits(_mem_available(root), cgroup_available, cgroup_name, _memlock(root))


def _path(root: str, *parts: str) -> str:
    return os.path.join(root, *(p.lstrip("/") for p in parts))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as handle:
            text = handle.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= UNLIMITED else value


def _mem_available(root: str) -> int | None:
    try:
        with open(_path(root, "proc/meminfo")) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _groups(root: str) -> dict[str, str]:
    """Controller -> group path from ``/proc/self/cgroup`` ("" for the v2 unified group)."""
    found = {}
    try:
        with open(_path(root, "proc/self/cgroup")) as handle:
            for line in handle:
                fields = line.rstrip("\n").split(":", 2)
                if len(fields) == 3:
                    for controller in fields[1].split(",") if fields[1] else [""]:
                        found[controller] = fields[2]
    except OSError:
        pass
    return found


def _cgroup(root: str) -> tuple[int | None, str | None]:
    groups = _groups(root)
    candidates = []
    if "" in groups:  # v2: the unified hierarchy
        for base in (_path(root, "sys/fs/cgroup", groups[""]), _path(root, "sys/fs/cgroup")):
            candidates.append(("cgroup v2", base, "memory.max", "memory.current"))
    if "memory" in groups:  # v1: the memory controller's own hierarchy
        for base in (
            _path(root, "sys/fs/cgroup/memory", groups["memory"]),
            _path(root, "sys/fs/cgroup/memory"),
        ):
            candidates.append(("cgroup v1", base, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    for version, base, limit_name, usage_name in candidates:
        limit = _read_int(os.path.join(base, limit_name))
        if limit is None:
            continue
        usage = _read_int(os.path.join(base, usage_name)) or 0
        return max(limit - usage, 0), f"{version} {base}"
    return None, None


def _memlock(root: str) -> int | None:
    if root != "/":  # a fake tree: its limits file, if it has one
        return _read_int(_path(root, "proc/self/memlock"))
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX hosts
        return None
    return None if soft == resource.RLIM_INFINITY or soft >= UNLIMITED else soft
