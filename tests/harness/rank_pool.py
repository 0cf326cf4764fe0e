"""A pool of long-lived CPU rank processes running megatron-core jobs over gloo.

Starting a rank costs seconds (torch + megatron-core imports), so tests share a pool and send
it jobs::

    pool = RankPool(world_size=2)
    losses = pool.run(train_job, steps=3, tp=1, pp=1, ep=1)   # one result per rank
    pool.close()

`run(fn, *args, tp=1, pp=1, ep=1, seed=DEFAULT_SEED, timeout=None, mp_kwargs=None, **kwargs)`
calls `fn(*args, **kwargs)` on every rank. `fn` must be a module-level function (it is pickled
by reference). The keyword names `tp`, `pp`, `ep`, `seed`, `timeout` and `mp_kwargs` belong to
`run` itself and are not passed to `fn`.

Around every job each rank:
- initializes `megatron.core.parallel_state` with the job's sizes (plus `mp_kwargs`, passed to
  `initialize_model_parallel`) and destroys it afterwards, including its process groups;
- reseeds python/numpy/torch and the model-parallel RNG tracker the way Megatron's training
  loop does, so a job's result does not depend on what ran before it.

Results (and job arguments) are pickled with tensors sent as compact CPU copies of their data,
so a view never drags its whole storage along and the parent does not need megatron-core. A job that raises on any rank raises `RankJobError` carrying each failing rank's
traceback text. A rank that dies or a job that exceeds its timeout raises `RankPoolBroken`;
all rank processes are then killed and the next `run()` starts a fresh set of ranks.

This module imports only the standard library at the top: rank processes set their thread
environment before torch is first imported.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import io
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

__all__ = [
    "DEFAULT_SEED",
    "DEFAULT_TIMEOUT",
    "RankJobError",
    "RankPool",
    "RankPoolBroken",
    "RankPoolError",
    "current_job",
    "seed_everything",
    "store_port",
]

DEFAULT_TIMEOUT = 300.0
DEFAULT_SEED = 1234
START_TIMEOUT = 180.0
# After one rank failed, how long the others get to finish before they are presumed stuck in a
# collective that the failed rank will never join.
FAILURE_GRACE = 15.0

REPO_ROOT = str(Path(__file__).resolve().parents[2])

# Float results depend on the thread count (reduction order), so every rank is single-threaded.
RANK_ENV = {
    # The ranks model a CPU machine (gloo, the CPU harness), on a GPU machine too: a test
    # that needs the GPU runs in the test process itself.
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCH_COMPILE_DISABLE": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONUNBUFFERED": "1",
}


class RankPoolError(RuntimeError):
    """Base class of the pool's errors."""


class RankJobError(RankPoolError):
    """A job raised on one or more ranks; `tracebacks` maps rank -> traceback text."""

    def __init__(self, message: str, tracebacks: dict[int, str]):
        super().__init__(message)
        self.tracebacks = tracebacks


class RankPoolBroken(RankPoolError):
    """A rank died or timed out; the pool's processes were killed."""


# --------------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------------

_JOB_INFO: dict = {}


def current_job() -> dict:
    """Inside a job: {'rank', 'world_size', 'job_id', 'tp', 'pp', 'ep', 'seed', 'mp_kwargs'}."""
    return dict(_JOB_INFO)


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _import_job_module(module_name: str, module_file: str | None, parent_path: list) -> None:
    """Make the job function's module importable under the name pickle will look up."""
    for entry in parent_path:
        if entry not in sys.path:
            sys.path.append(entry)
    if module_name in sys.modules or module_name == "__main__":
        return
    try:
        importlib.import_module(module_name)
        return
    except ImportError:
        if not module_file:
            raise
    # Test runners may import test files under names that are not importable from sys.path
    # (e.g. pytest's importlib mode); load the file itself under that name.
    spec = importlib.util.spec_from_file_location(module_name, module_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)


def _rebuild_tensor(data: bytes, dtype_name: str, shape: tuple):
    import torch

    dtype = getattr(torch, dtype_name)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _reduce_tensor(tensor):
    """A tensor as (raw bytes, dtype, shape): a compact CPU copy, never its whole storage.

    Plain tensor pickling is avoided on purpose: it serializes a view's entire storage, and
    megatron-core (0.19) replaces torch.storage._load_from_bytes at import, so the reader
    would have to import megatron-core just to unpickle a tensor.
    """
    import torch

    if tensor.layout != torch.strided:
        raise TypeError(f"cannot send a {tensor.layout} tensor; convert it to dense first")
    flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return _rebuild_tensor, (data, str(flat.dtype).removeprefix("torch."), tuple(tensor.shape))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        return NotImplemented


def _dumps(obj) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def seed_everything(seed: int = DEFAULT_SEED) -> None:
    """Megatron's training `_set_random_seed`: seed + 100 * pp_rank, then the RNG tracker.
    Done before every job; a job running several runs calls it before each."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _setup_job(options: dict) -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        _teardown_job()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=options["tp"],
        pipeline_model_parallel_size=options["pp"],
        expert_model_parallel_size=options["ep"],
        **(options.get("mp_kwargs") or {}),
    )
    seed_everything(options["seed"])


def _release_groups(groups: list) -> None:
    """Drop the last references to destroyed process groups, all at once.

    Each gloo group's destructor waits about 10 ms for its transport loop (with the GIL
    released) and initialize_model_parallel creates some 20 groups, so releasing them one by
    one would add ~0.2 s to every job. In parallel threads it takes ~20 ms. The threads are
    joined before the next job creates groups: letting the destructors overlap the next job's
    initialize_model_parallel was tried and hung them.
    """
    import threading

    boxes = [[group] for group in groups]
    groups.clear()
    threads = [threading.Thread(target=box.clear, daemon=True) for box in boxes]
    del boxes
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30.0)


def _teardown_job() -> None:
    import gc

    import torch.distributed as dist
    from megatron.core import parallel_state

    # destroy_model_parallel only forgets the groups; their gloo contexts (sockets, threads)
    # would otherwise accumulate with every job.
    groups, seen = [], set()
    for group in getattr(parallel_state, "_global_process_group_list", None) or []:
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or id(group) in seen:
            continue
        if group is dist.GroupMember.WORLD:
            continue
        seen.add(id(group))
        groups.append(group)
    parallel_state.destroy_model_parallel()
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except ValueError:
            pass  # already destroyed by the job itself

    _JOB_INFO.clear()
    # Free the job's models first (DDP and optimizers are full of reference cycles and hold
    # group references), so that `groups` holds the last references.
    gc.collect()
    _release_groups(groups)
    count = _thread_count()
    if count > _BASELINE_THREADS.setdefault("count", count):
        _free_stranded(gc)  # a full scan of the collector's objects: only when something stayed
        count = _thread_count()
    _BASELINE_THREADS["count"] = min(count, _BASELINE_THREADS["count"])


# The fewest threads the rank had after a job's teardown: a job whose objects keep their
# process groups alive leaves more. (The first teardown's count alone may include what the
# first job left behind, which would then never be freed.)
_BASELINE_THREADS: dict = {}


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # pragma: no cover - no procfs
        return 0


def _free_stranded(gc) -> None:
    """Empty the job's models, DDP wrappers and Megatron optimizers that outlived it.

    A model whose gradient hooks close over the DDP wrapper can be kept alive by autograd's
    own nodes (C++ references the collector cannot see: an fp32 model's optimizer holds views
    of its parameters, whose gradient nodes hold the hooks). Such a model keeps its process
    groups, and each gloo group three transport threads: a few hundred jobs left the rank
    processes with a thousand threads each. Megatron-FSDP jobs stranded more: its module, its
    distributed index and, with MoE, the whole model (its layers hold their groups), some 20
    gloo groups (60 threads per rank) per job, so a few dozen of them left every rank process
    with over a thousand threads and the machine's load average in the hundreds. Whatever is
    still alive after the collection is garbage of the finished job; emptying it releases
    what it holds.
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.optimizer import MegatronOptimizer
    from megatron.core.transformer.module import MegatronModule

    kinds = (DistributedDataParallel, MegatronOptimizer, MegatronModule, *_megatron_fsdp_holders())
    stranded = [o for o in gc.get_objects() if isinstance(o, kinds)]
    for obj in stranded:
        vars(obj).clear()
    del stranded
    gc.collect()


def _megatron_fsdp_holders() -> tuple:
    """What keeps a Megatron-FSDP job's process groups alive after it, beside its model: its
    ``MegatronFSDP`` module (autograd's nodes hold its hooks) and its distributed index. (Device
    meshes are not emptied: torch keeps some for the next job to reuse.)"""
    try:
        from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp, utils
    except ImportError:  # a megatron-core without Megatron-FSDP
        return ()
    return (megatron_fsdp.MegatronFSDP, utils.FSDPDistributedIndex)


def _rank_main(rank, world_size, port, conn, log_path, env, pg_timeout_s, megatron=True):
    if log_path:
        _redirect_output(log_path)
    os.environ.update(env)
    # Each rank leads its own process group: killing the group also reaches helpers a job may
    # spawn, and a Ctrl-C in the terminal reaches only the parent, which then kills the ranks.
    os.setpgrp()
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    import faulthandler

    faulthandler.enable(all_threads=True)
    # The parent sends SIGUSR1 before killing a stuck rank, so the log shows where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)

    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if megatron:
        from megatron_offload_testing import cpu_megatron

        cpu_megatron.install()
        # Import the heavy megatron-core modules now, while the parent waits for 'ready' anyway.
        import megatron.core.distributed  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401

    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    # Everything imported so far lives for the whole process; freezing it keeps the per-job
    # gc.collect() (which frees the job's models, full of reference cycles) fast.
    import gc

    gc.collect()
    gc.freeze()
    conn.send(("ready", os.getpid()))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if message[0] == "close":
            break
        _, job_id, parent_path, module_name, module_file, options, payload = message
        reply = None
        try:
            _import_job_module(module_name, module_file, parent_path)
            fn, args, kwargs = pickle.loads(payload)
            if megatron:
                _setup_job(options)
            _JOB_INFO.update(options, rank=rank, world_size=world_size, job_id=job_id)
            result = fn(*args, **kwargs)
            try:
                data = _dumps(result)
            except Exception as exc:
                raise TypeError(
                    f"job result of type {type(result).__name__} is not picklable: {exc}"
                ) from exc
            reply = ("ok", job_id, data)
        except BaseException:
            reply = ("error", job_id, traceback.format_exc())
        # Nothing of the job may outlive it (teardown frees its models).
        fn = args = kwargs = result = None
        try:
            if megatron:
                _teardown_job()
            else:
                _JOB_INFO.clear()
        except BaseException:
            if reply[0] == "ok":
                reply = ("error", job_id, "teardown failed:\n" + traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            break  # the parent is gone

    try:
        dist.destroy_process_group()
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def store_port() -> int:
    """A TCP port for rank 0's store, free on every interface (the store listens on all of
    them, and a port free on 127.0.0.1 alone may be held on the wildcard address: another
    suite's store) and drawn below the kernel's ephemeral range, which ``bind`` to port 0 and
    ``connect`` take ports from: between this check and the store's listen, nothing else (gloo's
    pair sockets, a store of torchrun's) is handed it, as a port from ``bind(0)`` could be."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port for a store below {low} (the ephemeral range)")


def _describe_exit(code) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class RankPool:
    """N spawned rank processes in one gloo process group, serving jobs one at a time."""

    def __init__(
        self,
        world_size: int = 2,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
        env: dict | None = None,
        capture_output: bool = True,
        megatron: bool = True,
    ):
        """
        world_size: number of ranks (2 or 4 are what the tests use).
        timeout: default per-job timeout in seconds.
        env: extra environment for the ranks, applied before torch is imported.
        capture_output: send each rank's stdout/stderr to a log file (`log_paths`) whose tail
            is quoted when a rank dies or hangs; False leaves them on the parent's streams.
        megatron: False starts ranks that import torch only (no megatron-core, no model
            parallel state around jobs): for tests of the pool itself, which start and break
            pools of their own and would pay megatron-core's imports at every start.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.env = {**RANK_ENV, **(env or {})}
        self.capture_output = capture_output
        self.megatron = megatron
        self.start_time_s: float | None = None
        self.starts = 0
        self._ctx = mp.get_context("spawn")
        self._procs: list = []
        self._conns: list = []
        self._log_dir: str | None = None
        self._job_id = 0
        self._log_offsets: list[int] = []
        self._broken = False
        atexit.register(self.close)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._procs)

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def log_paths(self) -> list[str]:
        if not self._log_dir:
            return []
        return [os.path.join(self._log_dir, f"rank{r}.log") for r in range(self.world_size)]

    def start(self) -> "RankPool":
        """Spawn the ranks and wait until every one has joined the process group (with a new
        port, up to three times, when another process took the port in between)."""
        for attempt in range(3):
            try:
                return self._start()
            except RankPoolBroken as error:
                if "EADDRINUSE" not in str(error) or attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start(self) -> "RankPool":
        if self.started:
            return self
        t0 = time.monotonic()
        self._broken = False
        if self.capture_output:
            self._log_dir = tempfile.mkdtemp(prefix=f"rank_pool{self.world_size}_")
        port = store_port()
        pg_timeout = max(self.timeout, 1800.0)
        for rank in range(self.world_size):
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            log_path = self.log_paths[rank] if self.capture_output else None
            proc = self._ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    self.world_size,
                    port,
                    child_conn,
                    log_path,
                    self.env,
                    pg_timeout,
                    self.megatron,
                ),
                name=f"rank{rank}",
                # Not daemonic: jobs may start processes of their own (dist_checkpointing's
                # writer uses a multiprocessing Manager). close() (also run at exit) ends them.
                daemon=False,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        try:
            self._collect(
                set(range(self.world_size)),
                time.monotonic() + self.start_timeout,
                what="start-up",
                expect="ready",
            )
        except BaseException:
            self._kill()
            raise
        self.start_time_s = time.monotonic() - t0
        self.starts += 1
        return self

    def restart(self) -> "RankPool":
        # A healthy pool is closed gracefully, so the ranks exit normally (and whatever they
        # record at exit, such as coverage data, is kept); a broken one is killed.
        self.close()
        return self.start()

    def close(self) -> None:
        """Ask the ranks to leave the process group and exit; kill whatever does not."""
        if not self._procs:
            self._cleanup_logs()
            return
        if not self._broken:
            for conn in self._conns:
                try:
                    conn.send(("close",))
                except (OSError, EOFError):
                    pass
            deadline = time.monotonic() + 30.0
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> "RankPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _kill(self) -> None:
        for proc in self._procs:
            # Each rank leads its own process group (see _rank_main), which also holds what a
            # job started (dist_checkpointing's Manager, a checkpoint writer): the group is
            # killed even when the rank itself has exited (closed, or died), or those would
            # outlive the pool as orphans.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                if proc.is_alive():
                    proc.kill()
        for proc in self._procs:
            proc.join(10.0)
        for conn in self._conns:
            conn.close()
        self._procs = []
        self._conns = []
        self._log_offsets = []
        self._cleanup_logs()

    def _cleanup_logs(self) -> None:
        if self._log_dir:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    # -- jobs --------------------------------------------------------------------------------

    def run(
        self,
        fn,
        /,
        *args,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        seed: int = DEFAULT_SEED,
        timeout: float | None = None,
        mp_kwargs: dict | None = None,
        **kwargs,
    ) -> list:
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results (rank order)."""
        if tp * pp > self.world_size or self.world_size % (tp * pp):
            raise ValueError(f"tp={tp} * pp={pp} does not divide world size {self.world_size}")
        if self._broken or not self.started:
            self.restart()
        module_name = getattr(fn, "__module__", None)
        module_file = getattr(sys.modules.get(module_name), "__file__", None)
        try:
            payload = _dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"cannot send job {fn!r}: the function must be module-level and its "
                f"arguments picklable ({exc})"
            ) from exc
        self._job_id += 1
        options = dict(tp=tp, pp=pp, ep=ep, seed=seed, mp_kwargs=mp_kwargs)
        message = ("job", self._job_id, list(sys.path), module_name, module_file, options, payload)
        # Failure reports quote only what the ranks logged during this job.
        self._log_offsets = [os.path.getsize(p) if os.path.exists(p) else 0 for p in self.log_paths]
        for conn in self._conns:
            try:
                conn.send(message)
            except OSError:
                pass  # a rank died while idle; _collect reports it
        timeout = self.timeout if timeout is None else timeout
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            return self._collect(
                set(range(self.world_size)),
                time.monotonic() + timeout,
                what=f"job {name}",
                expect="ok",
                job_id=self._job_id,
                timeout=timeout,
            )
        except RankPoolError:
            raise
        except BaseException:
            # Interrupted (Ctrl-C) with the job still running: the ranks' state is unknown.
            self._broken = True
            self._kill()
            raise

    def _collect(self, pending, deadline, *, what, expect, job_id=None, timeout=None):
        results = [None] * self.world_size
        errors: dict[int, str] = {}
        grace_deadline = None
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            conns = {self._conns[r]: r for r in pending}
            ready = mp_connection.wait(list(conns) + list(sentinels), timeout=remaining)
            # Drain replies before looking at deaths: a rank may answer and then exit.
            for obj in ready:
                if obj not in conns:
                    continue
                rank = conns[obj]
                try:
                    reply = obj.recv()
                except (EOFError, OSError):
                    continue  # its sentinel reports the death
                if job_id is not None and reply[1] != job_id:
                    continue
                pending.discard(rank)
                if reply[0] == "error":
                    errors[rank] = reply[2]
                elif expect == "ready":
                    results[rank] = reply[1]
                else:
                    try:
                        results[rank] = pickle.loads(reply[2])
                    except Exception:
                        errors[rank] = (
                            "the result could not be unpickled in the parent:\n"
                            + traceback.format_exc()
                        )
                if errors and grace_deadline is None:
                    grace_deadline = time.monotonic() + FAILURE_GRACE
            dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
            if dead:
                self._fail(what, dead, errors, reason="died")
        if pending:
            self._fail(
                what,
                sorted(pending),
                errors,
                reason="timed out" if grace_deadline is None else "hung after a failure",
                timeout=timeout,
            )
        if errors:
            raise RankJobError(self._format_errors(what, errors), errors)
        return results

    def _format_errors(self, what, errors):
        parts = [f"{what} failed on rank(s) {sorted(errors)} of {self.world_size}:"]
        for rank in sorted(errors):
            parts.append(f"--- rank {rank} traceback ---\n{errors[rank].rstrip()}")
        return "\n".join(parts)

    def _fail(self, what, ranks, errors, *, reason, timeout=None):
        """Kill the pool and raise RankPoolBroken describing what happened to `ranks`."""
        if reason != "died":
            for rank in ranks:
                try:
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            time.sleep(1.0)
        lines = []
        for rank in ranks:
            proc = self._procs[rank]
            if reason == "died":
                state = _describe_exit(proc.exitcode)
                lines.append(f"rank {rank} (pid {proc.pid}) died: {state}")
            else:
                limit = f" after {timeout:.0f} s" if timeout and reason == "timed out" else ""
                lines.append(f"rank {rank} (pid {proc.pid}) {reason}{limit}")
        header = (
            f"{what}: "
            + "; ".join(lines)
            + ". All ranks were killed; the next run() starts a fresh pool."
        )
        details = [header]
        if errors:
            details.append(self._format_errors(what, errors))
        for rank in ranks:
            tail = self._log_tail(rank)
            if tail:
                details.append(f"--- rank {rank} log (last lines) ---\n{tail}")
        self._broken = True
        self._kill()
        raise RankPoolBroken("\n".join(details))

    def _log_tail(self, rank, max_lines=40, max_width=300) -> str:
        paths = self.log_paths
        if not paths or not os.path.exists(paths[rank]):
            return ""
        offsets = self._log_offsets or [0] * self.world_size
        with open(paths[rank], errors="replace") as f:
            f.seek(offsets[rank])
            lines = [
                ln if len(ln) <= max_width else ln[:max_width] + " ..."
                for ln in f.read().splitlines()
                if ln.strip()
            ]
        return "\n".join(lines[-max_lines:])
