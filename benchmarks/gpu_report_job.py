"""One rank of a ``python -m benchmarks.gpu_report`` run: the pretrain example, measured.

    python -m benchmarks.gpu_report_job launch examples/pretrain_gpt.py <flags> --offload-optimizer-states
    python -m benchmarks.gpu_report_job direct examples/pretrain_gpt.py <flags>
    torchrun --standalone --nproc-per-node 8 -m benchmarks.gpu_report_job launch ...

``launch`` runs the script through ``megatron_offload.launch`` (offloading with the flag);
``direct`` runs it as plain ``python SCRIPT``, with no hook of this project's at all. Before
either, megatron.training's ``train_step`` is wrapped so that every iteration prints one line

    [gpu-report] {"kind": "iteration", "rank": 0, "iteration": 3, ...}

(JSON, written with one ``write`` so that the lines of several ranks do not interleave): the
device memory at the start of the iteration, its peak and the reserved memory, the caching
allocator's ``num_alloc_retries`` so far, host timestamps of the step, lm loss and grad norm
exactly (``float.hex``), and, where an offloader is attached, ``memory_allocated`` just
before and after each offload with the bytes the offload should free, and its ``stats()``.
After training, each rank times pinned-host <-> device copies of the size its offloader
copied (``copy_(non_blocking=True)`` between CUDA events) and prints a ``copy_bench`` line.

The memory figures read ``torch.cuda``; on a machine without CUDA (the unit tests run the
job on CPU ranks) they are null and the copy benchmark is skipped.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import runpy
import statistics
import sys
import time

from megatron_offload import find_offloader
from megatron_offload_testing.records import chain_members, exact

MARKER = "[gpu-report]"
STATS_KEYS = (
    "offloaded_bytes",
    "offloaded_payload_bytes",
    "host_bytes",
    "d2h_bytes",
    "h2d_bytes",
    "d2h_ms",
    "h2d_ms",
    "d2h_gbps",
    "h2d_gbps",
    "exposed_ms",
    "offload_seconds",
    "reload_seconds",
    "numa_node",
    "numa_bound",
    "numa_note",
)
COPY_REPEATS = 5


def emit(record: dict, fd: int = 1) -> None:
    """One line, one ``write`` (atomic on a pipe below PIPE_BUF; torchrun merges the ranks)."""
    os.write(fd, f"{MARKER} {json.dumps(record, sort_keys=True)}\n".encode())


class Probe:
    """The device memory figures of this process; all None without CUDA."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def allocated(self):
        if not self.cuda:
            return None
        import torch  # NOT EXERCISED (CUDA only)

        return torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        if self.cuda:
            import torch  # NOT EXERCISED (CUDA only)

            torch.cuda.reset_peak_memory_stats()

    def snapshot(self) -> dict:
        if not self.cuda:
            return {
                "max_allocated": None,
                "reserved": None,
                "alloc_retries": None,
                "allocated_exit": None,
            }
        import torch  # NOT EXERCISED (CUDA only)

        return {
            "max_allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
            "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0),
            "allocated_exit": torch.cuda.memory_allocated(),
        }


def state_bytes(optimizer) -> int:
    """Bytes of every per-parameter tensor the offloader moves by default: the inner
    optimizer's state tensors and the fp32 master shards (shapes only, no data read; the
    state mapping is read with dict's own lookup, which does not bring states back)."""
    import torch

    total = 0
    for dopt in chain_members(optimizer):
        for group in dopt.optimizer.param_groups:
            for param in group["params"]:
                for key, value in dict.get(dopt.optimizer.state, param, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and key != "step":
                        total += value.numel() * value.element_size()
        for group in getattr(dopt, "shard_fp32_from_float16_groups", None) or []:
            total += sum(m.numel() * m.element_size() for m in group if m is not None)
    return total


def master_grad_bytes(optimizer) -> int:
    """Bytes of the gradients the fp32 master shards hold now (each storage once)."""
    seen, total = set(), 0
    for dopt in chain_members(optimizer):
        for group in getattr(dopt, "shard_fp32_from_float16_groups", None) or []:
            for master in group:
                grad = None if master is None else master.grad
                if grad is not None and grad.untyped_storage().data_ptr() not in seen:
                    seen.add(grad.untyped_storage().data_ptr())
                    total += grad.untyped_storage().nbytes()
    return total


class IterationRecorder:
    """Wraps ``train_step`` (and the offload of an attached offloader) and emits the lines."""

    def __init__(
        self,
        *,
        offload: bool,
        probe: Probe,
        rank: int,
        world_size: int,
        emit=emit,
        clock=time.perf_counter,
    ) -> None:
        self.offload, self.probe, self.rank, self.world_size = offload, probe, rank, world_size
        self.emit, self.clock = emit, clock
        self.iteration = 0
        self.offloads: list[dict] = []
        self.last_stats: dict | None = None
        self._zero = clock()

    def watch(self, offloader, optimizer) -> None:
        """Read ``memory_allocated`` just before and after every release of the states (what
        the offloader's step cycle and ``offload()`` do), through its offload hooks."""
        if getattr(offloader, "_gpu_report_watched", False):
            return
        recorder = self
        pending = {}

        def before(offloader):
            pending["stats"] = offloader.stats()
            pending["grads"] = (
                master_grad_bytes(optimizer) if offloader.config.release_master_grads else 0
            )
            pending["before"] = recorder.probe.allocated()

        def after(offloader):
            allocated = recorder.probe.allocated()
            released = (
                offloader.stats()["offloaded_payload_bytes"]
                - pending["stats"]["offloaded_payload_bytes"]
            )
            recorder.offloads.append(
                {
                    "before": pending["before"],
                    "after": allocated,
                    "expected": released + pending["grads"],
                    "released_payload": released,
                    "master_grads": pending["grads"],
                }
            )

        offloader.register_offload_pre_hook(before)
        offloader.register_offload_post_hook(after)
        offloader._gpu_report_watched = True

    def wrap_train_step(self, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def train_step(*args, **kwargs):
            optimizer = signature.bind_partial(*args, **kwargs).arguments.get("optimizer")
            offloader = find_offloader(optimizer)
            if offloader is not None:
                self.watch(offloader, optimizer)
            self.iteration += 1
            self.offloads = []
            allocated_entry = self.probe.allocated()
            self.probe.reset_peak()
            t_entry = self.clock() - self._zero
            result = original(*args, **kwargs)
            t_exit = self.clock() - self._zero
            self.emit(self.record(result, optimizer, offloader, allocated_entry, t_entry, t_exit))
            return result

        return train_step

    def record(self, result, optimizer, offloader, allocated_entry, t_entry, t_exit) -> dict:
        loss_dict, skipped, grad_norm = result[0], result[1], result[5]
        calls = [c for c in self.offloads if c["before"] is not None and c["after"] is not None]
        entry = {
            "kind": "iteration",
            "rank": self.rank,
            "world_size": self.world_size,
            "offload": self.offload,
            "iteration": self.iteration,
            "t_entry": t_entry,
            "t_exit": t_exit,
            "allocated_entry": allocated_entry,
            **self.probe.snapshot(),
            "lm_loss": exact(loss_dict.get("lm loss")) if loss_dict else None,
            "grad_norm": exact(grad_norm),
            "skipped": int(skipped),
            "state_bytes": state_bytes(optimizer) if optimizer is not None else None,
            "offload_calls": len(self.offloads),
            "freed": sum(c["before"] - c["after"] for c in calls) if calls else None,
            "expected_freed": sum(c["expected"] for c in self.offloads) if self.offloads else None,
            "stats": None,
        }
        if offloader is not None:
            stats = offloader.stats()
            entry["stats"] = {key: stats.get(key) for key in STATS_KEYS}
            self.last_stats = entry["stats"]
        return entry


def copy_bench(nbytes_d2h: int, nbytes_h2d: int, repeats: int = COPY_REPEATS) -> dict:
    """Pinned host <-> device ``copy_(non_blocking=True)`` of the offloader's sizes, timed
    with CUDA events on the current stream; median of ``repeats``.

    NOT EXERCISED: CUDA only; nothing here has run on a GPU.
    """
    import torch

    out = {"kind": "copy_bench", "repeats": repeats}
    for name, nbytes, to_host in (("d2h", nbytes_d2h, True), ("h2d", nbytes_h2d, False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host.fill_(1)
        device.fill_(1)
        dst, src = (host, device) if to_host else (device, host)
        dst.copy_(src, non_blocking=True)  # one untimed copy
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        out.update(
            {
                f"{name}_bytes": nbytes,
                f"{name}_ms": ms,
                f"{name}_gbps": nbytes / (ms * 1e6) if ms else None,
            }
        )
        del host, device
    return out


def single_process_env(environ) -> None:
    """A process group of one when not started by torchrun (the 1-GPU run)."""
    if "RANK" in environ:
        return
    from .gpu import _free_port

    environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("launch", "direct"):
        raise SystemExit(
            "usage: python -m benchmarks.gpu_report_job launch|direct SCRIPT.py [ARGS...]"
        )
    route, script_argv = argv[0], argv[1:]
    single_process_env(os.environ)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # CPU ranks (the unit tests): the redirects the example itself installs
        from megatron_offload_testing import cpu_training

        cpu_training.install()
    import megatron.training.training as training

    recorder = IterationRecorder(
        offload=route == "launch",
        probe=Probe(cuda),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    training.train_step = recorder.wrap_train_step(training.train_step)
    if route == "launch":
        from megatron_offload import launch

        launch.main(script_argv)
    else:
        sys.argv = list(script_argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script_argv[0])))
        runpy.run_path(script_argv[0], run_name="__main__")
    stats = recorder.last_stats
    if not cuda:
        emit({"kind": "copy_bench", "rank": recorder.rank, "skipped": "no CUDA device"})
    elif stats and stats.get("d2h_bytes") and stats.get("h2d_bytes"):  # NOT EXERCISED (CUDA only)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # every rank copies at once, as the offloaders did
        emit({**copy_bench(stats["d2h_bytes"], stats["h2d_bytes"]), "rank": recorder.rank})


if __name__ == "__main__":
    main(sys.argv[1:])
