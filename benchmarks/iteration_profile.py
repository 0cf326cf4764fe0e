"""How many of the package's files, functions and calls one steady training iteration runs.

    python -m benchmarks.iteration_profile            # whole mode and chunked mode, on a CPU rank
    python -m benchmarks.iteration_profile --list     # and every function, with its calls

One gloo rank trains megatron-core's bf16 GPT (DistributedOptimizer, overlapped gradient
reduce and parameter gather) with the offloader attached, three iterations to reach the
steady state, then profiles the fourth (forward, backward, the prefetch from the gradient
reduction, the step with its wait, update and offload). Counted: the functions whose code
lives in ``megatron_offload/`` (the CPU stand-ins for CUDA, in ``megatron_offload_testing``,
are not counted), their files, and their calls; comprehensions, generator expressions and
lambdas are not counted as functions (their calls are not counted either).

Every start of a function is counted through ``sys.monitoring`` (Python 3.12), not with
cProfile: something in megatron-core's iteration resets cProfile's stack, which then drops
the functions still running at that moment (the step wrapper, the gradient-reduction
wrapper), so it counts fewer than ran.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import sys
from pathlib import Path
from typing import Callable

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_offload"
ANONYMOUS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return path.is_relative_to(PACKAGE)


def starts(fn: Callable[[], object]) -> dict[tuple[str, int, str], int]:
    """Run ``fn()`` and count the starts of every function whose code lives in the package:
    ``{(filename, first line, name): starts}``."""
    monitoring = sys.monitoring
    tool = next(i for i in range(1, 6) if monitoring.get_tool(i) is None)
    counts: collections.Counter = collections.Counter()

    def on_start(code, _offset):
        if _ours(code.co_filename):
            counts[(code.co_filename, code.co_firstlineno, code.co_name)] += 1
            return None
        return monitoring.DISABLE  # never asked again for this code

    monitoring.use_tool_id(tool, "iteration_profile")
    monitoring.restart_events()  # code an earlier count disabled is watched again
    try:
        monitoring.register_callback(tool, monitoring.events.PY_START, on_start)
        monitoring.set_events(tool, monitoring.events.PY_START)
        try:
            fn()
        finally:
            monitoring.set_events(tool, 0)
            monitoring.register_callback(tool, monitoring.events.PY_START, None)
    finally:
        monitoring.free_tool_id(tool)
    return dict(counts)


def count(entries: dict[tuple[str, int, str], int]) -> dict:
    """``{"files", "functions", "calls", "table"}`` of the package's own named functions among
    ``entries`` (``{(filename, first line, name): calls}``, as ``starts`` gives)."""
    table = []
    for (filename, line, name), calls in entries.items():
        if _ours(filename) and name not in ANONYMOUS:
            table.append(
                (str(Path(filename).resolve().relative_to(PACKAGE.parent)), line, name, calls)
            )
    table.sort()
    return {
        "files": len({t[0] for t in table}),
        "functions": len(table),
        "calls": sum(t[3] for t in table),
        "table": table,
    }


def profile_job(chunked: bool) -> dict:
    """One steady iteration on a gloo rank, profiled; runs in a process of its own."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_offload
    from megatron_offload.offloader.cycle import prefetching_finalize
    from megatron_offload_testing import cpu_megatron
    from tests.harness import models

    cpu_megatron.install()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(1234)
        model_parallel_cuda_manual_seed(1234)
        chunks, optimizer, config = models.build(
            "gpt", "bf16", overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=3000
        )
        options = {"chunked_update_bytes": 512 << 10} if chunked else {}
        offloader = megatron_offload.attach(optimizer, **options)
        # The reload starts while the gradients are reduced, as in Megatron's loop.
        config.finalize_model_grads_func = prefetching_finalize(
            config.finalize_model_grads_func, offloader
        )
        for step in range(3):
            models.train_step(chunks, optimizer, config, step)
        out = count(starts(lambda: models.train_step(chunks, optimizer, config, 3)))
        out["offloaded"] = offloader.stats()["offloaded_bytes"]
        return out
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.iteration_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--list", action="store_true", help="print every function counted")
    parser.add_argument("--mode", choices=("whole", "chunked", "both"), default="both")
    args = parser.parse_args(argv)
    from tests.harness.isolated import IsolatedProcess

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for mode in ("whole", "chunked") if args.mode == "both" else (args.mode,):
        process = IsolatedProcess(timeout=600)
        try:
            out = process.run(profile_job, mode == "chunked")
        finally:
            process.close()
        print(
            f"{mode}: {out['files']} files, {out['functions']} functions, {out['calls']} calls "
            f"(offloaded {out['offloaded']:,} bytes between steps)"
        )
        if args.list:
            for path, line, name, calls in out["table"]:
                print(f"  {path}:{line} {name} x{calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
