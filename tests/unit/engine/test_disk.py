"""The disk tier's files (``engine/disk.py``), against the real OS: faults are injected at the
boundary with it (``os`` calls that fail, a file cut short with ``ftruncate``, a process
killed with SIGKILL) or are real (a file larger than the disk's free space).

* a directory on tmpfs is refused, one that is not a directory too;
* a file the disk cannot hold is refused at allocation (ENOSPC, injected: a real one would
  fill the disk for every process meanwhile; EFBIG, real) and nothing is left;
* no name ever appears in the directory (``O_TMPFILE``, or created and removed at once), even
  in a process killed while writing;
* bytes written through the mapping come back bitwise after their pages left host memory
  (``write_back`` / ``drop``), and ``resident_bytes`` (mincore) says they left;
* a write error, a read error, a short read and a file cut short each raise ``DiskTierError``
  naming the directory, never a SIGBUS.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_offload.engine.disk import MEMORY_FILESYSTEMS, DiskTier
from megatron_offload.errors import DiskTierError, OffloadError
from tests.harness.disk import disk_directory, held_in, page_cache_bytes

MIB = 1 << 20


@pytest.fixture
def directory(tmp_path_factory):
    return disk_directory(tmp_path_factory)


def _memory_mount() -> str:
    """A writable directory on a filesystem held in memory (this machine's /dev/shm, or any
    tmpfs mount)."""
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point, kind = fields[4], fields[fields.index("-") + 1]
            if kind in MEMORY_FILESYSTEMS and os.access(point, os.W_OK) and os.path.isdir(point):
                return point
    raise AssertionError("no writable tmpfs mount on this machine to test the refusal with")


def test_a_directory_held_in_memory_or_missing_is_refused(directory):
    with pytest.raises(DiskTierError, match="host memory: it is not a disk tier"):
        DiskTier(_memory_mount())
    with pytest.raises(DiskTierError, match="is not a directory"):
        DiskTier(os.path.join(directory, "missing"))
    assert issubclass(DiskTierError, OffloadError) and issubclass(DiskTierError, OSError)
    assert DiskTier(directory).filesystem not in MEMORY_FILESYSTEMS


def test_a_file_the_disk_cannot_hold_is_refused_at_allocation_leaving_nothing(
    directory, monkeypatch
):
    # Not by asking the real disk for more than it has: the filesystem allocates what it can
    # before it says ENOSPC, and the disk is full for everyone meanwhile (other processes on
    # the machine then fail). The system's answer is injected (ENOSPC); a file over the
    # filesystem's largest one is refused by the real system at once (EFBIG).
    tier = DiskTier(directory)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(os, "posix_fallocate", full)
        with pytest.raises(DiskTierError) as raised:
            tier.file(MIB)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert directory in str(raised.value) and "Nothing was moved" in str(raised.value)
    assert os.listdir(directory) == [] and held_in(directory) == []
    with pytest.raises(DiskTierError) as raised:
        tier.file(1 << 62)
    assert raised.value.errno == errno.EFBIG, raised.value
    assert os.listdir(directory) == [] and held_in(directory) == []


@pytest.mark.parametrize("named", [False, True], ids=["O_TMPFILE", "created and removed"])
def test_bytes_come_back_bitwise_after_leaving_host_memory(directory, monkeypatch, named):
    if named:  # a filesystem without O_TMPFILE
        monkeypatch.delattr(os, "O_TMPFILE")
    tier = DiskTier(directory)
    file = tier.file(8 * MIB + 100)
    assert os.listdir(directory) == []  # no name, even for a file in use
    data = torch.randn(2 * MIB, generator=torch.Generator().manual_seed(0))
    view = file.buffer[100 : 100 + data.numel() * 4].view(torch.float32)
    view.copy_(data)
    assert file.resident_bytes() >= data.numel() * 4  # written: in the page cache
    file.write_back(view)
    assert file.resident_bytes() == 0
    file.check_readable(view)  # read with pread: cached again, for the copy that follows
    assert file.resident_bytes() >= data.numel() * 4
    assert torch.equal(view, data)
    file.drop()
    assert file.resident_bytes() == 0
    assert torch.equal(view, data)  # read back from the disk
    del view
    file.close()
    assert held_in(directory) == [] and os.listdir(directory) == []


def test_a_write_error_names_the_directory_and_keeps_the_pages(directory, monkeypatch):
    file = DiskTier(directory).file(MIB)
    file.buffer.fill_(7)

    def failing(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(DiskTierError) as raised:
        file.write_back(file.buffer, then="What it means here.")
    assert raised.value.errno == errno.EIO and directory in str(raised.value)
    assert str(raised.value).endswith("Input/output error. What it means here.")
    assert file.resident_bytes() == MIB  # not dropped: the pages may be all there is
    monkeypatch.undo()
    file.write_back(file.buffer)  # the same call again, with the disk sound
    assert file.resident_bytes() == 0 and bool((file.buffer == 7).all())
    file.close()


def test_read_errors_and_short_reads_raise_instead_of_a_sigbus(directory, monkeypatch):
    file = DiskTier(directory).file(4 * MIB)
    file.buffer.fill_(3)
    file.write_back(file.buffer)
    calls = []

    def eio(fd, buffers, offset):
        calls.append(offset)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", eio)
    with pytest.raises(DiskTierError, match="failed at byte") as raised:
        file.check_readable(file.buffer)
    assert raised.value.errno == errno.EIO and calls == [0]
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: 0)
    with pytest.raises(DiskTierError, match="returned short"):
        file.check_readable(file.buffer)
    monkeypatch.undo()
    file.check_readable(file.buffer)
    assert bool((file.buffer == 3).all())
    file.close()


CUT_SHORT = """
import os, sys, torch
from megatron_offload.engine.disk import DiskTier
from megatron_offload.errors import DiskTierError
directory = sys.argv[1]
file = DiskTier(directory).file(1 << 20)
file.buffer.fill_(1)
file.write_back(file.buffer)
def target(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the directory listing's own descriptor, closed since
        return ""
# The file's descriptors (Python's mmap keeps a duplicate of its own): the same file.
fd = [int(fd) for fd in os.listdir("/proc/self/fd") if target(fd).startswith(directory)][0]
os.ftruncate(fd, 1 << 19)  # the file cut short under the mapping
try:
    file.check_readable(file.buffer)
except DiskTierError as error:
    print("raised:", error)
"""


def test_a_file_cut_short_raises_before_anything_reads_it(directory):
    # In a process of its own: a read through the mapping past the end would be a SIGBUS.
    done = subprocess.run(
        [sys.executable, "-c", CUT_SHORT, directory], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "raised:" in done.stdout and "cut short to 524,288 bytes" in done.stdout, done.stdout


KILLED = """
import os, sys, torch
from megatron_offload.engine.disk import DiskTier
if sys.argv[2] == "named":
    del os.O_TMPFILE
file = DiskTier(sys.argv[1]).file(64 << 20)
print("writing", flush=True)
while True:
    file.buffer.add_(1)
    file.write_back(file.buffer)
"""


@pytest.mark.parametrize("named", ["O_TMPFILE", "named"])
def test_a_process_killed_while_writing_leaves_no_file(directory, named):
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED), directory, named],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "writing"
    finally:
        process.kill()
        process.wait(timeout=60)
    assert process.returncode == -9
    assert os.listdir(directory) == []


@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "buffered"])
def test_staged_writes_and_reads_are_bitwise_and_leave_no_page_cache(directory, direct):
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.disk import PARTS, staging_bytes

    device = CPUDevice()
    file = DiskTier(directory).file(8 * MIB)
    if not direct:  # a filesystem without direct I/O
        os.close(file.direct)
        file.direct = None
    elif file.direct is None:
        raise AssertionError(f"{directory} refuses O_DIRECT: this test needs a disk that has it")
    staging = device.host_buffer(staging_bytes(MIB))  # parts of a MiB: several chunks each way
    assert staging.numel() == PARTS * MIB
    source = torch.randn(7 * MIB // 4 + 3, generator=torch.Generator().manual_seed(1))
    host = file.buffer[4096 : 4096 + source.numel() * 4].view(torch.float32)
    file.write(host, source, staging, device)
    assert file.resident_bytes() == 0  # nothing of it in the page cache
    back = torch.empty_like(source)
    file.read(back, host, staging, device)
    assert file.resident_bytes() == 0
    assert torch.equal(back, source) and torch.equal(host, source)  # the mapping sees it too
    file.close()


def test_the_staging_is_faulted_in_when_it_is_allocated(directory):
    """The staging is the device's I/O buffer (``io_buffer``: in huge pages, wiped in a
    fork), and its pages get their memory when the budget allocates it, in one pass
    (``fault_in``), not a part at a time by the first copies among other allocations: the
    direct writes read them, and pages faulted in that way were scattered one page each
    (docs/disk-tier.md). ``mincore`` counts the pages that have memory."""
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.host import HostArena, HostBudget
    from tests.harness.disk import areas

    device = CPUDevice()
    arena = HostArena(device, HostBudget(16 * MIB, disk=DiskTier(directory)))
    assert arena.reserve(64 * MIB, "states")  # more than the budget: the rest in a file
    assert arena.disk is not None and arena.staging is not None
    assert page_cache_bytes(arena.staging) == arena.staging.numel() > 0
    start = arena.staging.data_ptr()
    staged = areas(start, start + arena.staging.numel())
    assert all("wf" in a["flags"] and "hg" in a["flags"] for a in staged), staged
    # A host buffer of this device has none until written: what the test above would see
    # without the staging's own pass.
    assert page_cache_bytes(device.host_buffer(arena.staging.numel())) == 0
    arena.disk.close()


def test_several_parts_are_written_at_once(directory, monkeypatch):
    """The I/O threads write ``WRITE_THREADS`` parts of the staging at once while the next part is
    copied (a disk reaches its rate only with several requests queued), and the bytes arrive
    whole: each ``pwrite`` here takes 50 ms, so the writes of one call overlap only if
    several run at the same time."""
    import threading
    import time

    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.disk import PARTS, WRITE_THREADS, staging_bytes

    assert 1 < WRITE_THREADS < PARTS  # one part is always free to be filled
    device = CPUDevice()
    file = DiskTier(directory).file(8 * MIB)
    staging = device.host_buffer(staging_bytes(MIB))  # parts of a MiB: 8 chunks
    source = torch.randn(2 * MIB, generator=torch.Generator().manual_seed(2))
    host = file.buffer[: source.numel() * 4].view(torch.float32)
    lock, running, most = threading.Lock(), [0], [0]
    original = os.pwrite

    def slow(fd, view, offset):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        try:
            return original(fd, view, offset)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(os, "pwrite", slow)
    file.write(host, source, staging, device)
    monkeypatch.undo()
    assert most[0] == WRITE_THREADS
    back = torch.empty_like(source)
    file.read(back, host, staging, device)
    assert torch.equal(back, source)
    file.close()


def test_a_staged_write_or_read_error_raises_and_leaves_the_source(directory, monkeypatch):
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.disk import staging_bytes

    device = CPUDevice()
    file = DiskTier(directory).file(4 * MIB)
    staging = device.host_buffer(staging_bytes(MIB))
    source = torch.arange(MIB, dtype=torch.float32)
    before = source.clone()
    host = file.buffer[: source.numel() * 4].view(torch.float32)
    calls = itertools.count(1)  # the I/O threads write at once: counted atomically

    def failing(fd, view, offset):
        if next(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(os.open(os.devnull, os.O_WRONLY), view)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(DiskTierError) as raised:
        file.write(host, source, staging, device)
    assert raised.value.errno == errno.ENOSPC and "device copy is kept" in str(raised.value)
    assert torch.equal(source, before)
    monkeypatch.undo()
    file.write(host, source, staging, device)  # the same call again
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: 0)
    back = torch.zeros_like(source)
    with pytest.raises(DiskTierError, match="returned short"):
        file.read(back, host, staging, device)
    monkeypatch.undo()
    file.read(back, host, staging, device)
    assert torch.equal(back, source)
    file.close()


def test_a_forked_child_writes_and_reads_with_a_thread_of_its_own(directory):
    """A forked child writes and reads with I/O threads of its own (its parent's are not in
    it), through the staging its parent made, which the fork gave it empty (``io_buffer``:
    wiped in a fork): a staging holds nothing from one copy to the next."""
    from megatron_offload.device.cpu import CPUDevice
    from megatron_offload.engine.disk import staging_bytes

    device = CPUDevice()
    staging = device.io_buffer(staging_bytes(MIB))
    source = torch.arange(MIB // 4, dtype=torch.float32)
    file = DiskTier(directory).file(MIB)
    file.write(file.buffer.view(torch.float32), source, staging, device)  # the parent's thread
    pid = os.fork()
    if pid == 0:  # the child: the parent's I/O thread is not here
        signal.alarm(60)  # a write waiting for a thread that is not there ends the child
        try:
            child = DiskTier(directory).file(MIB)
            host = child.buffer.view(torch.float32)
            child.write(host, source * 2, staging, device)
            back = torch.empty_like(source)
            child.read(back, host, staging, device)
            os._exit(0 if torch.equal(back, source * 2) else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    back = torch.empty_like(source)
    file.read(back, file.buffer.view(torch.float32), staging, device)
    assert torch.equal(back, source)
    file.close()
