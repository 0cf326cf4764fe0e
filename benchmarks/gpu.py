"""GPU measurements: step time with and without offloading, and peak device memory.

NOT EXERCISED: this project's machines have no GPU, so nothing in this module has ever run.
It is written to the CUDA semantics and reuses the code that does run on CPU ranks
(``megatron_bench.offload_job``, ``engine_bench``); what is GPU-only is here and kept short:
process-group setup (NCCL), device selection, and gathering the per-rank results.

Single GPU:   python -m benchmarks.offload_cycle --mode gpu
Several GPUs: torchrun --nproc-per-node 8 -m benchmarks.offload_cycle --mode gpu --tp 2
"""

from __future__ import annotations

import os
import socket

import torch

NOT_EXERCISED = "GPU path: NOT EXERCISED on the development machines (no GPU); figures are whatever this run measured"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(tp: int, pp: int, seed: int = 1234) -> None:
    """NCCL process group (from torchrun's environment, or a 1-rank group) and Megatron's
    model-parallel state, seeded as Megatron's training loop seeds it."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if "RANK" not in os.environ:  # plain `python -m`: a group of one
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown_distributed() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_megatron_on_gpus(main: dict, scaling: dict, *, tp: int, pp: int, seed: int = 1234):
    """``offload_job`` and ``scaling_job`` on this process's GPU, in one process group.

    Rank 0 gets ``(main results, scaling results)``, one entry per rank; other ranks None.
    The scaling job runs in the same layout as the main one (``--tp``/``--pp``).
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from .megatron_bench import offload_job, scaling_job

    init_distributed(tp, pp, seed)
    try:
        out = []
        for job, cfg in ((offload_job, main), (scaling_job, scaling)):
            torch.manual_seed(seed)  # each model starts from the same seeds, as on CPU ranks
            model_parallel_cuda_manual_seed(seed)
            result = job({**cfg, "device": "cuda"})
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            out.append(gathered)
            torch.cuda.empty_cache()  # the next model starts from an empty cache
        return tuple(out) if dist.get_rank() == 0 else None
    finally:
        shutdown_distributed()


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
