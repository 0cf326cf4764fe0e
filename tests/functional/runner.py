"""Launch examples/pretrain_gpt.py with torchrun and collect what each rank recorded.

A case is a set of Megatron flags and a world size. ``run(case, offload=..., device=...)``
runs it once per session (results are cached, so several tests share one launch) and returns
a ``Run``: the per-rank records of ``record_pretrain.py``, the combined log and the wall time.

Devices: ``cpu`` runs gloo ranks on the CPU (with ``CUDA_VISIBLE_DEVICES`` emptied, so it also
runs on the CPU on a GPU node); ``cuda`` runs nccl ranks, one GPU each.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
    command: list

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
) -> Run:
    """Launch ``case`` (cached per session). ``route``: 'launch' (through
    ``megatron_offload.launch``) or 'direct' (the plain script); default: 'launch' with
    offloading, 'direct' (a stock run, no megatron_offload hooks at all) without.
    ``script``: the pretrain script (default examples/pretrain_gpt.py; a Megatron-LM tree's
    own pretrain_gpt.py runs the same way, with the tree as ``pythonpath_prefix``).
    ``save_dir``: where the checkpoints go, kept after the run (default: a temporary
    directory removed with it); ``extra_flags``: added to the case's flags (``--load ...``)."""
    case = CASES[case] if isinstance(case, str) else case
    route = route or ("launch" if offload else "direct")
    key = (
        case.name,
        offload,
        device,
        route,
        pythonpath_prefix,
        str(script),
        save_dir,
        tuple(extra_flags),
    )
    if key in _CACHE:
        return _CACHE[key]
    workdir = tempfile.mkdtemp(prefix=f"mo_functional_{case.name}_")
    try:
        record_dir = os.path.join(workdir, "records")
        os.makedirs(record_dir)
        save_dir = save_dir or os.path.join(workdir, "checkpoints")
        command = [
            *TORCHRUN,
            "--standalone",
            f"--nproc-per-node={case.world_size}",
            str(RECORDER),
            route,
            str(script),
            *flags(case, offload=offload, device=device, save_dir=save_dir),
            *extra_flags,
        ]
        env = environment(device, pythonpath_prefix)
        for name in case.unset_env:
            env.pop(name, None)
        env.update(case.env)
        env["MO_RECORD_DIR"] = record_dir
        start = time.monotonic()
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
                f"{case.name} (offload={offload}, {device}) did not finish within "
                f"{RUN_TIMEOUT:.0f} s:\n{_tail(log)}"
            ) from None
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise AssertionError(
                f"{case.name} (offload={offload}, {device}, {route}) failed with exit code "
                f"{proc.returncode}:\n$ {' '.join(command)}\n{_tail(log)}"
            )
        ranks = []
        for rank in range(case.world_size):
            with open(os.path.join(record_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = Run(case, offload, device, route, ranks, log, seconds, command)
    _CACHE[key] = result
    return result


def _tail(log: str, lines: int = 60) -> str:
    return "\n".join(log.splitlines()[-lines:])
