"""NVIDIA's DeepSeek-V3 Megatron-FSDP recipe, scaled down, through the stock-style pretrain script.

Megatron-LM core_r0.19.0's ``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh`` on 2 gloo
ranks: a 4-layer model with multi-latent attention, MoE (sigmoid router with expert bias, fp32
router, group top-k, seq_aux_loss, forced load balancing, shared experts, the alltoall
dispatcher on expert parallel 2), multi-token prediction, SwiGLU, RMSNorm, qk-layernorm,
selective recompute (mlp, moe, mla_up_proj, layernorm), ``--manual-gc``, ``--log-params-norm``
and ``--log-num-zeros-in-grad``, saves every 2 iterations (under Megatron-FSDP). Both ways the recipe trains:

* **Megatron-FSDP** (its FSDP block: ``optim_grads_params``, ``fsdp_dtensor`` checkpoints,
  ``--fsdp-double-buffer``, bf16 gradient communication and main gradients,
  ``--calculate-per-token-loss``, overlapped gather and reduce);
* **the DistributedOptimizer** (the same flags without the FSDP block, ``torch_dist``).

What the CPU cannot run is left out, each for its reason: Transformer Engine, flash attention,
the flex dispatcher, grouped GEMM and the fused permutation are GPU kernels (the local
implementation and the alltoall dispatcher compute the same model); ``--use-nccl-ub`` needs
NCCL (served all the same: ``tests/integration/offloader/test_megatron_fsdp.py``);
``--init-model-with-meta-device`` makes even two plain CPU runs differ, so nothing could be
compared bitwise. What megatron-core 0.19.2 itself needs to run the rest on a CPU is in the
CPU harness (``megatron_offload_testing/cpu_megatron.py``, ``_serve_the_deepseek_recipe``).

Shown, on every rank: each iteration's loss, gradient norm and parameter norm bitwise those of
the plain script; nothing the offloader manages on the device as any iteration starts, the first
included (the plain run holds it all). Under Megatron-FSDP also: a run resumed with offloading
from the offloaded run's first checkpoint bitwise the plain script resumed from its own (not the
run that never stopped: megatron-core does not checkpoint the MoE router's state, so a resume
differs from it, with or without offloading; the DistributedOptimizer's resumes are
``test_async_save_resume.py``'s); and no late access to freed memory: the offloaded run has
every tensor storage behind guard pages (``megatron_offload_testing/guard_pages``: a freed
storage inaccessible and never reused, so a reader or writer that comes late faults at once
instead of corrupting memory handed out again).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import pytest

from megatron_offload_testing import guard_pages
from tests.functional import runner

SAVE_INTERVAL = 2
ITERATIONS = 3  # saves after iterations 2 and 3 (the interval, and megatron.training's last)

MODEL = (
    # The recipe's model, scaled down.
    *("--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128"),
    *("--num-attention-heads", "4", "--kv-channels", "16"),
    *("--position-embedding-type", "rope", "--rotary-base", "10000", "--no-rope-fusion"),
    *("--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu"),
    *("--untie-embeddings-and-output-weights", "--disable-bias-linear", "--qk-layernorm"),
    *("--attention-dropout", "0.0", "--hidden-dropout", "0.0"),
    *("--adam-beta1", "0.9", "--adam-beta2", "0.95"),
    # Multi-latent attention (the local core attention needs --v-head-dim == --kv-channels).
    *("--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16"),
    *("--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"),
    *("--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0"),
    # MoE: the first layer dense, as the recipe's first three.
    *("--num-experts", "4", "--moe-layer-freq", "[0]*1+[1]*3", "--moe-ffn-hidden-size", "32"),
    *("--moe-shared-expert-intermediate-size", "32", "--moe-router-topk", "2"),
    *("--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4"),
    *("--moe-router-pre-softmax", "--moe-router-group-topk", "1", "--moe-router-num-groups", "2"),
    *("--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid"),
    *("--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3"),
    *("--moe-router-dtype", "fp32", "--moe-router-force-load-balancing"),
    *("--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2"),
    *("--expert-tensor-parallel-size", "1"),
    *("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"),
    # How the recipe trains it.
    *("--recompute-granularity", "selective"),
    *("--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm"),
    *("--manual-gc", "--manual-gc-interval", "10", "--no-check-for-nan-in-loss-and-grad"),
    *("--overlap-grad-reduce", "--overlap-param-gather", "--bf16"),
    *("--log-params-norm", "--log-num-zeros-in-grad", "--log-interval", "1"),
)
FSDP = (
    *("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"),
    *("--calculate-per-token-loss", "--ckpt-format", "fsdp_dtensor", "--fsdp-double-buffer"),
    *("--megatron-fsdp-grad-comm-dtype", "bf16", "--megatron-fsdp-main-grads-dtype", "bf16"),
)
WAYS = {"megatron-fsdp": FSDP, "distributed-optimizer": ()}


def _case(way: str, *, resumed: bool = False) -> runner.Case:
    return runner.Case(
        f"deepseek-v3-{way}" + ("-resumed" if resumed else ""),
        2,
        MODEL + WAYS[way],
        train_iters=ITERATIONS,
        # The DistributedOptimizer's saves (0 device bytes, served from the host copy) and
        # resumes are test_pretrain_offload.py's and test_async_save_resume.py's.
        save_interval=None if resumed or way != "megatron-fsdp" else SAVE_INTERVAL,
        description=f"the scaled DeepSeek-V3 recipe, {way}",
        # Megatron-FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (the recipe unsets it too).
        unset_env=("CUDA_DEVICE_MAX_CONNECTIONS",),
    )


def _values(run, rank):
    return [(e["lm_loss"], e["grad_norm"], e["skipped"]) for e in run.ranks[rank]["iterations"]]


def _params_norms(run) -> list[str]:
    return re.findall(r"params norm: ([0-9.eE+-]+)", run.log)


@pytest.fixture(scope="module", params=list(WAYS))
def runs(request, tmp_path_factory):
    """(way, offloaded run, plain run, the directory under which each saved). Under
    Megatron-FSDP the offloaded run has every tensor storage behind guard pages."""
    way = request.param
    root = str(tmp_path_factory.mktemp(way))
    case = _case(way)
    if way == "megatron-fsdp":
        environment = guard_pages.environment(guard_pages.build(root), {})
        case = dataclasses.replace(
            case, env=tuple((k, environment[k]) for k in ("LD_PRELOAD", "PYTHONFAULTHANDLER"))
        )
    on = runner.run(case, offload=True, save_dir=os.path.join(root, "on"))
    off = runner.run(_case(way), offload=False, save_dir=os.path.join(root, "off"))
    return way, on, off, root


def test_the_recipe_trains_bitwise_offloaded_with_nothing_held_between_steps(runs):
    way, on, off, _ = runs
    for rank in range(2):
        assert len(on.ranks[rank]["iterations"]) == ITERATIONS
        assert _values(on, rank) == _values(off, rank), (way, rank)
        for index, entry in enumerate(on.ranks[rank]["iterations"]):
            where = f"{way}, rank {rank}, iteration {index + 1}"
            stats = entry["offloader"]
            assert stats["is_offloaded"] and stats["resident_bytes"] == 0, where
            assert stats["offloaded_bytes"] == entry["expected_offload_bytes"] > 0, where
            # As every iteration starts, the first included (attach sent the masters out).
            assert entry["held_at_start"] == 0, where
        assert all(e["held_at_start"] > 0 for e in off.ranks[rank]["iterations"]), (way, rank)
        if way == "megatron-fsdp":
            # Each save reads the host copy: nothing on the device as it starts, while torch
            # DCP writes (the DTensors it writes, the SwiGLU halves included) and after it.
            saves = on.ranks[rank]["save_storage_bytes"]
            assert [s["iteration"] for s in saves] == [2, 3], (way, rank)
            for save in saves:
                assert save["before"] == save["after"] == 0, (way, rank, saves)
                assert save["written_device_bytes"] == [0], (way, rank, saves)
            plain = off.ranks[rank]["save_storage_bytes"]
            assert all(s["written_device_bytes"][0] > 0 for s in plain), (way, rank, plain)
    norms = _params_norms(off)
    assert len(norms) == ITERATIONS and _params_norms(on) == norms, way


def _resume_from(root: str, side: str, into: str) -> str:
    """A copy of ``side``'s checkpoints under ``into`` that resumes after the first save."""
    shutil.copytree(os.path.join(root, side), into)
    for later in range(SAVE_INTERVAL + 1, ITERATIONS + 1):
        shutil.rmtree(os.path.join(into, f"iter_{later:07d}"), ignore_errors=True)
    with open(os.path.join(into, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(SAVE_INTERVAL))
    return into


@pytest.mark.parametrize("runs", ["megatron-fsdp"], indirect=True)
def test_a_resume_trains_on_bitwise_as_the_plain_scripts_resume(runs, tmp_path):
    way, _, _, root = runs
    case = _case(way, resumed=True)
    on = runner.run(
        case,
        offload=True,
        extra_flags=("--load", _resume_from(root, "on", str(tmp_path / "on"))),
    )
    off = runner.run(
        case,
        offload=False,
        extra_flags=("--load", _resume_from(root, "off", str(tmp_path / "off"))),
    )
    for rank in range(2):
        assert len(on.ranks[rank]["iterations"]) == ITERATIONS - SAVE_INTERVAL
        assert _values(on, rank) == _values(off, rank), (way, rank)
        assert all(e["held_at_start"] == 0 for e in on.ranks[rank]["iterations"]), (way, rank)
        # The load wrote the host copy (the offloader attached before it): nothing of the
        # states and masters on the device in the DTensors torch DCP read into, nor after
        # it, where the plain load holds them all.
        (load_on,) = on.ranks[rank]["loads"]
        (load_off,) = off.ranks[rank]["loads"]
        assert load_on["read_device_bytes"] == [0] and load_on["after"] == 0, (rank, load_on)
        assert load_off["read_device_bytes"][0] > 0 and load_off["after"] > 0, (rank, load_off)
    assert _params_norms(on) == _params_norms(off), way


@pytest.mark.parametrize("runs", ["megatron-fsdp"], indirect=True)
def test_the_offloaded_run_touched_no_freed_storage(runs):
    """The offloaded run had every tensor storage behind guard pages (a late reader or writer
    would have faulted it: ``tests/functional/test_heap.py`` shows the guard catches one) and
    trained bitwise as the plain run."""
    _, on, off, _ = runs
    preloaded = dict(on.case.env).get("LD_PRELOAD", "")
    assert preloaded.endswith("guard_pages.so"), on.case.env
    for rank in range(2):
        assert _values(on, rank) == _values(off, rank), rank
