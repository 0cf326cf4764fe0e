"""Launch examples/pretrain_gpt.py with torchrun and collect what each rank recorded.

A case is a set of Megatron flags and a world size. ``run(case, offload=..., device=...)``
runs it once per session (results are cached, so several tests share one launch) and returns
a ``Run``: the per-rank records of ``record_pretrain.py``, the combined log and the wall time.

Devices: ``cpu`` runs gloo ranks on the CPU (with ``CUDA_VISIBLE_DEVICES`` emptied, so it also
runs on the CPU on a GPU node); ``cuda`` runs nccl ranks, one GPU each.

Launches on the CPU of the installed megatron-core with no library preloaded fork their ranks
from the session's fork server (``forkserver.py``: torch and megatron imported once, each rank
given torchrun's environment) instead of starting torchrun, which saves about 5 s of a core
per rank and 3 s per launch; the others (a Megatron source tree first on ``PYTHONPATH``, a
preloaded allocator, GPUs) and every launch with ``MEGATRON_OFFLOAD_TORCHRUN=1`` in the
environment go through torchrun itself.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_offload_testing.pretrain_flags import gpt_flags, schedule_flags

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pretrain_gpt.py"
RECORDER = REPO / "tests" / "functional" / "record_pretrain.py"
FORKSERVER = REPO / "tests" / "functional" / "forkserver.py"
# torchrun as a module of this interpreter: an environment need not have the console script.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RUN_TIMEOUT = 420.0

# A small GPT trained the way pretrain_gpt.py trains: mock data, the local transformer
# implementation, no fused CUDA kernels (all also valid on GPUs), exact per-iteration values.
MODEL_FLAGS = [
    *gpt_flags(),
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    *schedule_flags(lr="1e-3", min_lr="1e-4"),
    "--log-interval",
    "2",
    # Batches are read in the training process: loader workers (spawned, importing torch
    # again, when the asynchronous checkpoint worker sets the start method) cost seconds per
    # run and change no value.
    "--num-workers",
    "0",
]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world_size: int
    flags: tuple
    train_iters: int = 5
    save_interval: int | None = None
    description: str = ""
    offload_flags: tuple = ()  # added only to the run with offloading
    # Environment variables the case needs unset (Megatron-FSDP refuses
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which the others set).
    unset_env: tuple = ()
    # (name, value) pairs set in the ranks' environment (a preloaded allocator).
    env: tuple = ()


CASES = {
    case.name: case
    for case in (
        Case(
            "dp2",
            2,
            ("--bf16",),
            save_interval=3,
            description="data parallel 2, bf16 (fp32 master weights), checkpoint saves at "
            "iterations 3 and 5",
        ),
        Case(
            "tp2pp2",
            4,
            (
                "--fp16",
                "--initial-loss-scale",
                "1048576",
                "--hysteresis",
                "1",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
            ),
            train_iters=6,
            description="tensor parallel 2 x pipeline parallel 2, fp16 with dynamic loss "
            "scaling (steps 1 and 3 overflow and are skipped), overlapped grad reduce and "
            "param gather",
        ),
    )
}


@dataclasses.dataclass
class Run:
    case: Case
    offload: bool
    device: str
    route: str
    ranks: list  # per-rank records: {'iterations': [...], 'saves': [...]}
    log: str
    seconds: float
    command: list  # the torchrun command line (what a forked launch stands in for)
    launcher: str  # "torchrun" or "forkserver"

    def offload_lines(self) -> list[dict]:
        """The offloader's log lines (``megatron_offload_testing.log_lines``)."""
        from megatron_offload_testing.log_lines import parse_log_lines

        return parse_log_lines(self.log)


_CACHE: dict = {}


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def flags(case: Case, *, offload: bool, device: str, save_dir: str | None) -> list[str]:
    args = list(MODEL_FLAGS) + list(case.flags) + ["--train-iters", str(case.train_iters)]
    args += ["--distributed-backend", "gloo" if device == "cpu" else "nccl"]
    if case.save_interval is not None and save_dir is not None:
        args += ["--save", save_dir, "--save-interval", str(case.save_interval)]
    if offload:
        args.append("--offload-optimizer-states")
        args += list(case.offload_flags)
    return args


def environment(device: str, pythonpath_prefix: str | None = None) -> dict:
    env = dict(os.environ)
    # A patched megatron tree must come before the installed megatron-core.
    paths = ([pythonpath_prefix] if pythonpath_prefix else []) + [str(REPO)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Results depend on the thread count; TP needs this on pre-Blackwell GPUs (and on CPU ranks).
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        CUDA_DEVICE_MAX_CONNECTIONS="1",
        PYTHONUNBUFFERED="1",
    )
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def run(
    case: Case | str,
    *,
    offload: bool,
    device: str = "cpu",
    route: str | None = None,
    pythonpath_prefix: str | None = None,
    script: str | Path = EXAMPLE,
    save_dir: str | None = None,
    extra_flags: tuple = (),
    launcher: str | None = None,
) -> Run:
    """Launch ``case`` (cached per session). ``route``: 'launch' (through
    ``megatron_offload.launch``) or 'direct' (the plain script); default: 'launch' with
    offloading, 'direct' (a stock run, no megatron_offload hooks at all) without.
    ``script``: the pretrain script (default examples/pretrain_gpt.py; a Megatron-LM tree's
    own pretrain_gpt.py runs the same way, with the tree as ``pythonpath_prefix``).
    ``save_dir``: where the checkpoints go, kept after the run (default: a temporary
    directory removed with it); ``extra_flags``: added to the case's flags (``--load ...``).
    ``launcher``: 'torchrun' or 'forkserver'; default: the fork server where it can serve
    the launch (the module's docstring), else torchrun."""
    case = CASES[case] if isinstance(case, str) else case
    route = route or ("launch" if offload else "direct")
    servable = device == "cpu" and pythonpath_prefix is None and not case.env
    if launcher is None:
        forced = os.environ.get("MEGATRON_OFFLOAD_TORCHRUN") == "1"
        launcher = "forkserver" if servable and not forced else "torchrun"
    if launcher not in ("torchrun", "forkserver"):
        raise ValueError(f"launcher {launcher!r}: use 'torchrun' or 'forkserver'")
    if launcher == "forkserver" and not servable:
        raise ValueError(
            f"the fork server cannot run {case.name} on {device} (it serves CPU launches of "
            "the installed megatron-core with no preloaded library): use launcher='torchrun'"
        )
    key = (
        case.name,
        offload,
        device,
        route,
        pythonpath_prefix,
        str(script),
        save_dir,
        tuple(extra_flags),
        launcher,
    )
    if key in _CACHE:
        return _CACHE[key]
    workdir = tempfile.mkdtemp(prefix=f"mo_functional_{case.name}_")
    try:
        record_dir = os.path.join(workdir, "records")
        os.makedirs(record_dir)
        save_dir = save_dir or os.path.join(workdir, "checkpoints")
        argv = [
            route,
            str(script),
            *flags(case, offload=offload, device=device, save_dir=save_dir),
            *extra_flags,
        ]
        command = [*TORCHRUN, "--standalone", f"--nproc-per-node={case.world_size}"]
        command += [str(RECORDER), *argv]
        env = environment(device, pythonpath_prefix)
        for name in case.unset_env:
            env.pop(name, None)
        env.update(case.env)
        env["MO_RECORD_DIR"] = record_dir
        what = f"{case.name} (offload={offload}, {device}, {route})"
        start = time.monotonic()
        if launcher == "forkserver":
            log = fork_launch(case.world_size, RECORDER, argv, env, workdir, what)
        else:
            log = _torchrun(command, env, workdir, what)
        seconds = time.monotonic() - start
        ranks = []
        for rank in range(case.world_size):
            with open(os.path.join(record_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = Run(case, offload, device, route, ranks, log, seconds, command, launcher)
    _CACHE[key] = result
    return result


def _torchrun(command: list, env: dict, workdir: str, what: str) -> str:
    """Run torchrun; its combined output, or AssertionError when it fails or times out."""
    proc = subprocess.Popen(
        command,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(
            f"{what} did not finish within {RUN_TIMEOUT:.0f} s:\n{_tail(log)}"
        ) from None
    if proc.returncode != 0:
        raise AssertionError(
            f"{what} failed with exit code {proc.returncode}:\n$ {' '.join(command)}\n{_tail(log)}"
        )
    return log


class _ForkServer:
    """The session's fork server (``forkserver.py``), started at the first launch it serves."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._stderr: str | None = None

    def _start(self) -> subprocess.Popen:
        fd, self._stderr = tempfile.mkstemp(prefix="mo_forkserver_", suffix=".log")
        with os.fdopen(fd, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(FORKSERVER)],
                cwd=str(REPO),
                env=environment("cpu"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )
        self._proc = proc
        self._reply("starting the fork server", RUN_TIMEOUT)
        return proc

    def _reply(self, what: str, timeout: float) -> dict:
        proc = self._proc
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        with open(self._stderr) as f:
            stderr = f.read()
        self.stop()
        raise AssertionError(
            f"{what}: the fork server "
            + (f"did not answer within {timeout:.0f} s" if not ready else "ended")
            + f"; its output:\n{_tail(stderr)}"
        )

    def stop(self) -> None:
        """Kill the server and every rank it forked (one process group)."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait()
            self._proc = None
            os.unlink(self._stderr)

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def launch(self, world_size, script, argv, env, workdir, what, timeout) -> str:
        if self.pid is None:
            self.stop()  # one that ended: its output file goes with it
            self._start()
        proc = self._proc
        log_path = os.path.join(workdir, "output.log")
        request = dict(world_size=world_size, script=str(script), argv=argv, env=env)
        request.update(cwd=workdir, log=log_path)
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        try:
            codes = self._reply(what, timeout)["returncodes"]
        except AssertionError as error:
            raise AssertionError(
                f"{error}\nthe launch's output:\n{_tail(_read(log_path))}"
            ) from None
        log = _read(log_path)
        if any(codes):
            raise AssertionError(f"{what} failed (forked ranks' exit codes {codes}):\n{_tail(log)}")
        return log


_SERVER = _ForkServer()
atexit.register(_SERVER.stop)


def fork_launch(
    world_size: int,
    script: str | Path,
    argv: list,
    env: dict,
    workdir: str,
    what: str,
    timeout: float = RUN_TIMEOUT,
) -> str:
    """Run ``script`` with ``argv`` on ``world_size`` ranks forked from the session's fork
    server (started at the first call), in ``workdir`` with ``env`` and torchrun's variables;
    their combined output. AssertionError when a rank fails (the others killed), or when the
    launch takes over ``timeout`` seconds (the server and its ranks killed; the next call
    starts another)."""
    return _SERVER.launch(world_size, script, argv, env, workdir, what, timeout)


def fork_server_pid() -> int | None:
    """The session's fork server's process id, while it runs."""
    return _SERVER.pid


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""


def _tail(log: str, lines: int = 60) -> str:
    return "\n".join(log.splitlines()[-lines:])
