"""How many of the package's files, functions and calls one steady training iteration runs.

    python -m benchmarks.iteration_profile            # whole mode and chunked mode, on a CPU rank
    python -m benchmarks.iteration_profile --list     # and every function, with its calls

One gloo rank trains megatron-core's bf16 GPT (DistributedOptimizer, overlapped gradient
reduce and parameter gather) with the offloader attached, three iterations to reach the
steady state, then profiles the fourth (forward, backward, the prefetch from the gradient
reduction, the step with its wait, update and offload) with cProfile. Counted: the functions
whose code lives in ``megatron_offload/`` (the CPU stand-ins for CUDA, in
``megatron_offload_testing``, are not counted), their files, and their calls; comprehensions, generator expressions and
lambdas are not counted as functions (their calls are not counted either).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import socket
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_offload"
ANONYMOUS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")


def _ours(filename: str) -> bool:
    path = Path(filename).resolve()
    return path.is_relative_to(PACKAGE)


def count(stats: pstats.Stats) -> dict:
    """``{"files", "functions", "calls", "table"}`` of the package's own named functions."""
    table = []
    for (filename, line, name), (_cc, calls, _tt, _ct, _callers) in stats.stats.items():
        if _ours(filename) and name not in ANONYMOUS:
            table.append((str(Path(filename).resolve().relative_to(PACKAGE.parent)), line, name, calls))
    table.sort()
    return {"files": len({t[0] for t in table}), "functions": len(table), "calls": sum(t[3] for t in table),
            "table": table}


def profile_job(chunked: bool) -> dict:
    """One steady iteration on a gloo rank, profiled; runs in a process of its own."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_offload
    from megatron_offload.integration.training import prefetching_finalize
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
        chunks, optimizer, config = models.build("gpt", "bf16", overlap_grad_reduce=True, overlap_param_gather=True,
                                                 bucket_size=3000)
        options = {"chunked_update_bytes": 512 << 10} if chunked else {}
        offloader = megatron_offload.attach(optimizer, **options)
        # The reload starts while the gradients are reduced, as in Megatron's loop.
        config.finalize_model_grads_func = prefetching_finalize(config.finalize_model_grads_func, offloader)
        for step in range(3):
            models.train_step(chunks, optimizer, config, step)
        profiler = cProfile.Profile()
        profiler.enable()
        models.train_step(chunks, optimizer, config, 3)
        profiler.disable()
        out = count(pstats.Stats(profiler))
        out["offloaded"] = offloader.stats()["offloaded_bytes"]
        return out
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.iteration_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print every function counted")
    parser.add_argument("--mode", choices=("whole", "chunked", "both"), default="both")
    args = parser.parse_args(argv)
    from tests.support.isolated import IsolatedProcess

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for mode in (("whole", "chunked") if args.mode == "both" else (args.mode,)):
        process = IsolatedProcess(timeout=600)
        try:
            out = process.run(profile_job, mode == "chunked")
        finally:
            process.close()
        print(f"{mode}: {out['files']} files, {out['functions']} functions, {out['calls']} calls "
              f"(offloaded {out['offloaded']:,} bytes between steps)")
        if args.list:
            for path, line, name, calls in out["table"]:
                print(f"  {path}:{line} {name} x{calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
