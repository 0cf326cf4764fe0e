"""The real CUDA caching allocator under offloading: no retries in steady state, bytes returned.

Marked ``gpu``: where ``torch.cuda.is_available()`` these tests run and must pass (a failure
after that point fails, it does not skip); elsewhere they are skipped with the reason. The
job's own logic also runs on the CPU (``test_gpu_allocator_job_logic_runs_on_cpu``), with the
allocator figures left out, so that it is known to work before it meets a GPU.

Each case trains a bf16 MLP (overlapped gradient reduce and parameter gather, one rank, NCCL)
with the states offloaded in pieces, in a fresh process. After two warm-up iterations the
process's device memory is capped (``torch.cuda.set_per_process_memory_fraction``) at the
peak reserved so far plus one piece: from then on, a forward pass that cannot reuse the
offloaded pieces' memory in time makes the allocator retry (synchronize and free its cache,
``num_alloc_retries``) or fail. Asserted per iteration from ``torch.cuda.memory_stats()``:
``num_alloc_retries`` does not grow after the first two iterations, and ``offload()`` returns
at least the offloaded bytes to the allocator (``memory_allocated`` drops by them).
"""

from __future__ import annotations

import socket

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
STEPS, WARMUP = 6, 2
PIECE = 8 << 20  # small against the state, so that it is split into many pieces


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def allocator_job(port, max_piece_bytes, dry_run=False, hidden=2048, layers=8):
    """Train with offloading on cuda:0 and read the allocator after every iteration.

    ``dry_run`` runs the same code on CPU ranks (gloo, CUDA calls redirected) with small
    sizes and without allocator figures.
    """
    import torch.distributed as dist

    if dry_run:
        from megatron_offload_testing import cpu_megatron

        cpu_megatron.install()
    torch.cuda.set_device(0)
    dist.init_process_group(
        "gloo" if dry_run else "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        return _train(max_piece_bytes, dry_run, hidden, layers)
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


def _allocator() -> dict:
    stats = torch.cuda.memory_stats()
    return {
        "retries": stats.get("num_alloc_retries", 0),
        "ooms": stats.get("num_ooms", 0),
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }


def _train(max_piece_bytes, dry_run, hidden, layers):

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_offload
    from tests.harness import models

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    chunks, optimizer, config = models.build(
        "mlp",
        "bf16",
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        bucket_size=1 << 22,
        num_layers=layers,
        hidden=hidden,
        seq_length=16 if dry_run else 512,
        micro_batch_size=4,
    )
    offloader = megatron_offload.attach(optimizer, max_piece_bytes=max_piece_bytes)
    spec = config.harness_spec
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)

    def forward_step(data_iterator, model):
        batch = {k: v.to(device) for k, v in next(data_iterator).items()}
        return models._forward_step(spec, iter([batch]), model)

    figures = []
    for step in range(STEPS):
        if step == WARMUP and not dry_run:
            # From now on the process may hold no more than it needed so far plus one piece.
            torch.cuda.synchronize()
            cap = torch.cuda.max_memory_reserved() + max_piece_bytes
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([models._micro_batch(spec, step, 0)]),
            model=chunks,
            num_microbatches=1,
            seq_length=spec.seq_length,
            micro_batch_size=spec.micro_batch_size,
            forward_only=False,
        )
        ok, _, _ = optimizer.step()
        if not dry_run:
            torch.cuda.synchronize()
        stats = offloader.stats()
        figures.append(
            {
                "ok": bool(ok),
                "pieces": stats["pieces"],
                "offloaded": stats["offloaded_bytes"],
                "tracked": stats["tracked_bytes"],
                "allocator": None if dry_run else _allocator(),
            }
        )
    # Bytes returned: reload, then offload again and see the allocator's count drop.
    offloader.reload()
    offloader.wait()
    if dry_run:
        returned = None
    else:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        offloader.offload()
        torch.cuda.synchronize()
        torch.empty(1, device=device)  # lets the allocator process the recorded frees
        returned = before - torch.cuda.memory_allocated()
    return {"figures": figures, "returned": returned, "tracked": offloader.stats()["tracked_bytes"]}


def _run(max_piece_bytes, dry_run=False, **sizes):
    from tests.harness.isolated import IsolatedProcess

    process = IsolatedProcess(timeout=900)
    try:
        return process.run(allocator_job, _free_port(), max_piece_bytes, dry_run, **sizes)
    finally:
        process.close()


def _assert_pieces(out, max_piece_bytes):
    figures = out["figures"]
    assert all(f["ok"] for f in figures)
    for f in figures:
        assert f["offloaded"] == f["tracked"] > 0
        assert sum(f["pieces"].values()) > len(f["pieces"])  # every kind split into pieces


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU; none is present")
@pytest.mark.parametrize("max_piece_bytes", [PIECE], ids=["8MiB-pieces"])
def test_no_allocator_retries_in_steady_state_on_a_gpu(max_piece_bytes):
    out = _run(max_piece_bytes)
    _assert_pieces(out, max_piece_bytes)
    retries = [f["allocator"]["retries"] for f in out["figures"]]
    ooms = [f["allocator"]["ooms"] for f in out["figures"]]
    print(
        f"\nnum_alloc_retries per iteration: {retries}; reserved/allocated per iteration: "
        f"{[(f['allocator']['reserved'], f['allocator']['allocated']) for f in out['figures']]}"
    )
    assert retries[-1] == retries[WARMUP - 1], f"allocator retries in steady state: {retries}"
    assert ooms[-1] == 0, ooms
    assert out["returned"] >= out["tracked"], (out["returned"], out["tracked"])
