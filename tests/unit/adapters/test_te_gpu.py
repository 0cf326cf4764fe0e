"""The real Transformer Engine FusedAdam on a GPU: precision-aware training, offloaded.

Marked ``te_gpu`` (and ``gpu``). Where ``torch.cuda.is_available()`` and the
``transformer_engine`` package is installed, these tests run and must pass: any failure after
that point, including an import error inside Transformer Engine or megatron-core not picking
TE's FusedAdam, fails the test. Elsewhere they are skipped with the missing piece in the reason
(``pytest -rs`` shows it). Combinations the installed TE release does not support (bf16 moments
before TE 2.3, remainders before 2.1) are skipped with that reason.

Each case trains megatron-core's DDP + DistributedOptimizer (1 rank, NCCL) in a fresh process
twice, with and without ``megatron_offload.attach``, and compares losses, model parameters and
every byte of optimizer state. Between steps every per-element state buffer (FP8 data and
transposes included) must hold no device memory, and ``torch.cuda.memory_allocated`` must drop
by at least the offloaded bytes.
"""

from __future__ import annotations

import importlib.util
import socket

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None

if HAVE_CUDA and HAVE_TE:
    _SKIP = None
elif HAVE_CUDA:
    _SKIP = "Transformer Engine is not installed (a CUDA GPU is present)"
elif HAVE_TE:
    _SKIP = "no CUDA GPU (Transformer Engine is installed)"
else:
    _SKIP = "needs Transformer Engine and a CUDA GPU; neither is present"

pytestmark = [
    pytest.mark.te_gpu,
    pytest.mark.gpu,
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
]

STEPS = 5
MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.uint8}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _state_buffers(value):
    """A state's per-element buffers: the tensor, or a quantized tensor's data buffers."""
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return [value]
    return [
        getattr(value, n)
        for n in ("_data", "_transpose", "_rowwise_data", "_columnwise_data")
        if isinstance(getattr(value, n, None), torch.Tensor)
    ]


def _census(inner) -> tuple[int, int]:
    """(max storage bytes, total tensor bytes) over every per-element state buffer."""
    sizes, total = [], 0
    for group in inner.param_groups:
        for p in group["params"]:
            # dict's own lookup: the guarded mapping would bring offloaded states back.
            for value in dict.get(inner.state, p, {}).values():
                if not isinstance(value, torch.Tensor):
                    continue
                for buf in _state_buffers(value):
                    if buf.numel() == p.numel():
                        sizes.append(buf.untyped_storage().nbytes())
                        total += buf.numel() * buf.element_size()
    return max(sizes, default=0), total


def _snapshot(chunks, inner) -> dict:
    out = {f"param.{n}": p.detach().cpu().clone() for n, p in chunks[0].named_parameters()}
    for g, group in enumerate(inner.param_groups):
        out[f"step.{g}"] = group.get("step")
        for i, p in enumerate(group["params"]):
            for key, value in inner.state.get(p, {}).items():
                if type(value) in (torch.Tensor, torch.nn.Parameter):
                    out[f"{g}.{i}.{key}"] = value.detach().cpu().clone()
                elif isinstance(value, torch.Tensor):
                    for attr in ("_data", "_transpose", "_scale_inv"):
                        inner_value = getattr(value, attr, None)
                        if isinstance(inner_value, torch.Tensor):
                            out[f"{g}.{i}.{key}.{attr}"] = inner_value.detach().cpu().clone()
            for key, scale in getattr(inner, "_scales", {}).get(p, {}).items():
                out[f"{g}.{i}._scales.{key}"] = scale.detach().cpu().clone()
    return out


def gpu_job(port, remainders, moments, offload, dry_run=False, chunked=None, checkpoint=None):
    """One precision-aware run on cuda:0 with the real TE FusedAdam (in a fresh process).

    ``chunked``: attach with the chunked update (``chunked_update_bytes`` this fraction of the
    state, raised to what the largest parameter needs, TE's fp32 temporaries included).
    ``checkpoint``: a directory; after ``STEPS // 2`` steps the run saves a dist_checkpointing
    checkpoint (precision-aware: TE's unscaled states) and loads it back into the running,
    offloaded optimizer (every state replaced) before training on.

    ``dry_run`` runs the same code on the CPU (gloo, megatron-core's CUDA calls redirected,
    the TE double injected) so that this job's own logic is exercised where there is no GPU.
    """
    import contextlib

    import torch.distributed as dist

    if checkpoint is not None:
        import multiprocessing

        # dist_checkpointing's writer starts a multiprocessing Manager, and multiprocessing
        # refuses children to a daemonic process (the isolated worker is one). The worker is
        # ended by its parent's close(); the Manager is shut down with it at its exit.
        multiprocessing.current_process().daemon = False
    if dry_run:
        from megatron_offload_testing import cpu_megatron

        cpu_megatron.install()
    torch.cuda.set_device(0)
    backend = "gloo" if dry_run else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        if dry_run:
            from tests.harness.doubles import megatron_injection, te_fused_adam

            injection = megatron_injection.te_fused_adam_injected()
            te_version, te_adam = te_fused_adam.TE_VERSION, te_fused_adam.FusedAdam
        else:
            import transformer_engine
            import transformer_engine.pytorch.optimizers as te_optimizers

            injection = contextlib.nullcontext()
            te_version, te_adam = str(transformer_engine.__version__), te_optimizers.FusedAdam
        with injection:
            return _train(
                remainders, moments, offload, dry_run, te_version, te_adam, chunked, checkpoint
            )
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


def _train(
    remainders, moments, offload, dry_run, te_version, te_adam, chunked=None, checkpoint=None
):
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_offload
    from megatron_offload.adapters import megatron_wrappers as adapter
    from tests.harness import models

    assert mcore_optimizer.Adam is te_adam, (
        f"megatron-core uses {mcore_optimizer.Adam!r}, not Transformer Engine's FusedAdam"
    )
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    overrides = dict(
        use_precision_aware_optimizer=True,
        store_param_remainders=remainders,
        exp_avg_dtype=MOMENTS[moments],
        exp_avg_sq_dtype=MOMENTS[moments],
    )
    chunks, optimizer, config = models.build("mlp", "bf16", optimizer_overrides=overrides)
    distrib = models.distributed_optimizers(optimizer)[0]
    inner = distrib.optimizer
    assert isinstance(inner, te_adam)
    options = {}
    if chunked is not None:
        from tests.harness import optimizer_jobs

        options["chunked_update_bytes"] = optimizer_jobs.chunked_budget(optimizer, chunked)
    offloader = megatron_offload.attach(optimizer, **options) if offload else None
    spec = config.harness_spec
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)

    def batch(step):
        gen = torch.Generator().manual_seed(step)
        shape = (spec.seq_length, spec.micro_batch_size, spec.hidden)
        return (
            torch.randn(shape, generator=gen).to(device),
            torch.randn(shape, generator=gen).to(device),
        )

    def forward_step(data_iterator, model):
        inputs, targets = next(data_iterator)
        output = model(inputs, targets)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses, figures = [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch(step)]),
            model=chunks,
            num_microbatches=1,
            seq_length=spec.seq_length,
            micro_batch_size=spec.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        losses.append((float(reduced[0]["loss"]), float(grad_norm), bool(ok)))
        if offloader:
            torch.cuda.synchronize()
            collected = [t for _, t in adapter.collect(distrib)]
            stats = offloader.stats()
            figures.append(
                {
                    "max_storage": max(t.untyped_storage().nbytes() for t in collected),
                    "subclasses": sum(type(t) is not torch.Tensor for t in collected),
                    "census_max_storage": _census(inner)[0],
                    "tracked": stats["tracked_bytes"],
                    "offloaded": stats["offloaded_bytes"],
                    "kept": stats["kept_resident_bytes"],
                    "update_chunks": stats.get("update_chunks", 0),
                }
            )
        # After the figures: a load replaces every state (offloaded again at the next step).
        if checkpoint is not None and step == STEPS // 2 - 1:
            import os

            from megatron.core import dist_checkpointing

            from tests.integration.adapters.test_te_checkpoint import _load, _sharded

            os.makedirs(checkpoint, exist_ok=True)
            dist_checkpointing.save(_sharded(chunks, optimizer), checkpoint)
            _load(chunks, optimizer, checkpoint)
    freed = None
    if offloader:
        offloader.reload()
        offloader.wait()
        tracked = offloader.stats()["tracked_bytes"]
        census_total = _census(inner)[1]
        assert census_total == tracked, (census_total, tracked)
        if not dry_run:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            offloader.offload()
            torch.cuda.synchronize()
            torch.empty(1, device=device)  # lets the allocator process the recorded frees
            freed = (resident - torch.cuda.memory_allocated(), tracked)
            offloader.reload()
            offloader.wait()
        else:
            freed = (tracked, tracked)
    torch.cuda.synchronize()
    return {
        "te_version": te_version,
        "losses": losses,
        "figures": figures,
        "freed": freed,
        "snapshot": _snapshot(chunks, inner),
    }


def _run(remainders, moments, offload, dry_run=False, chunked=None, checkpoint=None, process=None):
    """``gpu_job`` in a fresh process, or in ``process`` (the dry runs share one)."""
    from tests.harness.isolated import IsolatedProcess

    if process is not None:
        return process.run(
            gpu_job, _free_port(), remainders, moments, offload, dry_run, chunked, checkpoint
        )
    process = IsolatedProcess(timeout=600)
    try:
        return _run(remainders, moments, offload, dry_run, chunked, checkpoint, process)
    finally:
        process.close()


def _te_version() -> str:
    import transformer_engine  # an ImportError here fails the test: TE is meant to work

    return str(transformer_engine.__version__)


def _assert_bitwise_and_offloaded(reference, offloaded):
    assert offloaded["losses"] == reference["losses"]
    ref, off = reference["snapshot"], offloaded["snapshot"]
    assert ref.keys() == off.keys()
    different = []
    for key, value in ref.items():
        other = off[key]
        if isinstance(value, torch.Tensor):
            same = value.dtype == other.dtype and torch.equal(
                value.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)
            )
        else:
            same = value == other
        if not same:
            different.append(key)
    assert not different, different[:5]
    assert offloaded["figures"]
    for fig in offloaded["figures"]:
        assert fig["tracked"] > 0 and fig["offloaded"] == fig["tracked"] and fig["kept"] == 0
        assert fig["subclasses"] == 0 and fig["max_storage"] == 0
        assert fig["census_max_storage"] == 0
    freed, tracked = offloaded["freed"]
    assert freed >= tracked, (freed, tracked)


@pytest.mark.parametrize("remainders", [True, False])
@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp8"])
def test_real_te_precision_aware_training_is_bitwise_identical_offloaded(remainders, moments):
    version = _skip_unsupported(remainders, moments)
    reference = _run(remainders, moments, False)
    offloaded = _run(remainders, moments, True)
    assert reference["te_version"] == offloaded["te_version"] == str(version)
    _assert_bitwise_and_offloaded(reference, offloaded)


def _skip_unsupported(remainders, moments):
    from packaging.version import Version

    version = Version(_te_version())
    if moments == "bf16" and version < Version("2.3"):
        pytest.skip(f"Transformer Engine {version} has no bf16 moments (TE 2.3+)")
    if remainders and version < Version("2.1"):
        pytest.skip(f"Transformer Engine {version} has no store_param_remainders (TE 2.1+)")
    return version


@pytest.mark.parametrize("remainders", [True, False])
@pytest.mark.parametrize("moments", ["bf16", "fp8"])
def test_real_te_chunked_update_is_bitwise_identical(remainders, moments):
    """The chunked update on real TE: FP8 moments (data and, where allocated, transposes) and
    bf16 moments (updated in place from TE 2.13) streamed through slots with the masters."""
    version = _skip_unsupported(remainders, moments)
    reference = _run(remainders, moments, False)
    chunked = _run(remainders, moments, True, chunked=0.3)
    assert reference["te_version"] == chunked["te_version"] == str(version)
    _assert_bitwise_and_offloaded(reference, chunked)
    # Streamed in several chunks at every step after the first (states created at the first).
    assert all(f["update_chunks"] >= 2 for f in chunked["figures"][1:]), chunked["figures"]


@pytest.mark.parametrize("moments", ["fp32", "fp8"])
def test_real_te_precision_aware_chunked_checkpoint_round_trip(tmp_path, moments):
    """Save and load back a precision-aware checkpoint mid-run, chunked update attached."""
    version = _skip_unsupported(True, moments)
    reference = _run(True, moments, False, checkpoint=str(tmp_path / "ref"))
    chunked = _run(True, moments, True, chunked=0.3, checkpoint=str(tmp_path / "off"))
    assert reference["te_version"] == chunked["te_version"] == str(version)
    _assert_bitwise_and_offloaded(reference, chunked)
    chunks = [f["update_chunks"] for f in chunked["figures"]]
    assert all(n >= 2 for i, n in enumerate(chunks) if i not in (0, STEPS // 2)), chunks
