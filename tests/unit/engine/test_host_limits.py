"""What the node and the container can give, read from fake /proc and /sys trees: cgroup v2
and v1 (the process's group, else the mount's root), "max" and huge limits as none, and
MemAvailable; the smaller of them is what is available."""

import pytest

from megatron_offload.engine import host_limits


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path)


MEMINFO = "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n"


def test_cgroup_v2_in_the_process_group(tmp_path):
    root = _tree(
        tmp_path,
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/job/rank3\n",
            "sys/fs/cgroup/job/rank3/memory.max": f"{8 << 30}\n",
            "sys/fs/cgroup/job/rank3/memory.current": f"{3 << 30}\n",
        },
    )
    limits = host_limits.read(root)
    assert limits.mem_available == 20000000 * 1024
    assert limits.cgroup_available == 5 << 30 and limits.cgroup_name.startswith("cgroup v2")
    assert limits.available == 5 << 30 and "room" in limits.describe()


def test_cgroup_v1_at_the_mount_root_and_unlimited_values(tmp_path):
    root = _tree(
        tmp_path,
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "4:memory:/outside/view\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{30 << 30}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1 << 30}\n",
        },
    )
    limits = host_limits.read(root)
    assert limits.cgroup_available == 29 << 30 and limits.cgroup_name.startswith("cgroup v1")
    assert limits.available == 20000000 * 1024  # MemAvailable is the smaller here
    unlimited = _tree(
        tmp_path / "u",
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/\n",
            "sys/fs/cgroup/memory.max": "max\n",
        },
    )
    assert host_limits.read(unlimited).cgroup_available is None
    huge = _tree(
        tmp_path / "h",
        {
            "proc/self/cgroup": "4:memory:/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        },
    )
    assert host_limits.read(huge).available is None  # no meminfo either: nothing limits


@pytest.mark.parametrize("text, expected", [("8388608\n", 8 << 20), ("max\n", None)])
def test_the_locked_memory_limit(tmp_path, text, expected):
    root = _tree(tmp_path, {"proc/self/memlock": text})
    assert host_limits.read(root).memlock == expected


def test_this_machine_reads_without_error():
    limits = host_limits.read()
    assert limits.mem_available is None or limits.mem_available > 0
