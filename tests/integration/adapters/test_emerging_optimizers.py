"""Lion, Muon and SOAP (megatron-core 0.19's emerging optimizers) with offloading.

megatron-core builds ``--optimizer lion | muon | soap`` from the ``emerging-optimizers``
package as a ChainedOptimizer of ``Float16OptimizerWithFloat16Params`` (the emerging optimizer
for matrix parameters, AdamW for the rest), and with ``--use-distributed-optimizer`` as a
``LayerWiseDistributedOptimizer`` (a ChainedOptimizer of the same wrappers, each rank updating
whole parameters of its own). Their states: Lion ``exp_avg``; Muon ``momentum_buffer``; SOAP
``exp_avg``, ``exp_avg_sq`` and its preconditioners ``L``, ``R``, ``Q_L``, ``Q_R`` (new
tensors at every step for four of them). Every comparison is bitwise, on a bf16 GPT on gloo
CPU ranks (the shared rank pool); the tests are skipped, with the reason, where the package is
missing. Their kernels use ``torch.compile``, which the rank pool disables
(``TORCH_COMPILE_DISABLE``, see ``tests/harness/rank_pool.py``).
"""

import importlib.util

import pytest
import torch

from tests.harness.compare import assert_bitwise_equal
from tests.harness.optimizer_jobs import STATS_KEYS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("emerging_optimizers") is None,
    reason="needs the emerging-optimizers package (requirements/py312.txt: emerging-optimizers==0.3.0)",
)

OPTIMIZERS = ["lion", "muon", "soap"]
INNER = {"lion": "Lion", "muon": "TensorParallelMuon", "soap": "SOAP"}
# Full-size state tensors per matrix parameter, found in the state (not from these names).
STATE_KEYS = {
    "lion": {"exp_avg"},
    "muon": {"momentum_buffer"},
    "soap": {"exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R"},
}


def _leaves(optimizer):
    from tests.harness import models

    return models.megatron_optimizers(optimizer)


def _figures(offloader, optimizer):
    stats = offloader.stats()
    sizes = []
    for leaf in (member.optimizer for member in offloader.members):
        from megatron_offload.adapters import megatron_wrappers as adapter

        sizes += [t.untyped_storage().nbytes() for _, t in adapter.collect(leaf)]
    return {
        **{k: stats[k] for k in STATS_KEYS},
        "pieces": sum(stats["pieces"].values()),
        "max_storage": max(sizes, default=0),
    }


def _state_facts(offloader, optimizer):
    """Per inner optimizer class: the state keys of its tensors, and whether the engine
    tracks every one of them (and how many bytes they take per parameter element)."""
    facts = {}
    for engine, leaf in ((m.engine, m.optimizer) for m in offloader.members):
        name = type(leaf.optimizer).__name__
        entry = facts.setdefault(
            name, {"keys": set(), "untracked": [], "state_bytes": 0, "numel": 0}
        )
        for group in leaf.optimizer.param_groups:
            for param in group["params"]:
                state = dict.get(leaf.optimizer.state, param) or {}
                entry["numel"] += param.numel()
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        entry["keys"].add(key)
                        entry["state_bytes"] += value.numel() * value.element_size()
                        if engine.locate(value) is None:
                            entry["untracked"].append(key)
    return facts


def emerging_job(
    name, steps, offload, *, layer_wise=False, options=None, checked=False, skip_at=None, rl_at=None
):
    import megatron_offload
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    chunks, optimizer, config = models.build(
        "gpt", "bf16", optimizer=name, use_distributed_optimizer=False, layer_wise=layer_wise
    )
    devices = []
    if checked:
        options, devices = checked_device_options(options)
    offloader = megatron_offload.attach(optimizer, **(options or {})) if offload else None
    results, figures = [], []
    for step in range(steps):
        skip = step == skip_at
        if skip:  # a step skipped by the grad-norm threshold, as ChainedOptimizer does
            for leaf in [optimizer] + _leaves(optimizer):
                leaf.config.grad_norm_skip_threshold = 0.0
        results.append(models.train_step(chunks, optimizer, config, step))
        if skip:
            for leaf in [optimizer] + _leaves(optimizer):
                leaf.config.grad_norm_skip_threshold = float("inf")
        if offloader:
            figures.append(_figures(offloader, optimizer))
        if step == rl_at:
            rl = _rl_phase(chunks, optimizer, config, offloader)
    facts = None
    if offloader:
        offloader.reload()
        offloader.wait()
        facts = _state_facts(offloader, optimizer)
    snapshot = models.snapshot(chunks, optimizer)
    check_devices(devices)
    return {
        "results": results,
        "figures": figures,
        "snapshot": snapshot,
        "facts": facts,
        "rl": rl if rl_at is not None else None,
        "update_chunks": offloader.stats()["update_chunks"] if offloader else 0,
        "classes": [
            type(leaf).__name__ + "/" + type(leaf.optimizer).__name__ for leaf in _leaves(optimizer)
        ],
        "top": type(optimizer).__name__,
        "checked": len(devices),
    }


def _rl_phase(chunks, optimizer, config, offloader):
    """An RL rollout between steps: forward passes with the states and masters freed, through
    the offloader's block and through megatron-core's own offload_to_cpu/restore_from_cpu."""
    from tests.harness import models

    seen = {}
    batch = models._micro_batch(config.harness_spec, 1000, 0)

    def rollout():
        chunks[0](
            batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
        )

    def all_offloaded():
        stats = offloader.stats()
        return stats["offloaded_bytes"] == stats["tracked_bytes"]

    with torch.no_grad():
        if offloader:
            with offloader.offloaded(offload_master_weights=True):
                seen["block_offloaded"] = all_offloaded()
                rollout()
            # As before the block: the step cycle's.
            seen["back_after_block"] = offloader.is_offloaded
            optimizer.offload_to_cpu()
            seen["offload_to_cpu_routed"] = all_offloaded()
            rollout()
            optimizer.restore_from_cpu()
            seen["restored"] = not offloader.is_offloaded
        else:
            rollout()
            rollout()
    return seen


def _assert_offloaded_between_steps(offloaded, chunked=False):
    for rank in offloaded:
        for figures in rank["figures"]:
            assert figures["tracked_bytes"] > 0
            assert figures["offloaded_bytes"] == figures["tracked_bytes"] == figures["host_bytes"]
            assert figures["resident_bytes"] == 0 and figures["kept_resident_bytes"] == 0
            assert figures["max_storage"] == 0  # no state or master holds device memory
        last = rank["figures"][-1]
        # Steady state: one copy per piece and direction, whatever the tensor count (SOAP's
        # replaced tensors are put back where the layout has them).
        if chunked:  # the states move through the slots; the masters (one piece each) whole
            assert last["d2h_copies"] == last["h2d_copies"] == len(rank["classes"])
        else:
            assert last["d2h_copies"] == last["h2d_copies"] == last["pieces"]


@pytest.mark.parametrize("layer_wise", [False, True], ids=["chained", "layer-wise"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_emerging_optimizer_is_bitwise_identical_with_offloading(
    rank_pool, name, layer_wise, reference_run
):
    reference = reference_run(emerging_job, name, 5, False, layer_wise=layer_wise)
    offloaded = rank_pool.run(emerging_job, name, 5, True, layer_wise=layer_wise)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(offloaded)
    top = "LayerWiseDistributedOptimizer" if layer_wise else "ChainedOptimizer"
    for rank in offloaded:
        assert rank["top"] == top
        assert rank["classes"] == [
            f"Float16OptimizerWithFloat16Params/{INNER[name]}",
            "Float16OptimizerWithFloat16Params/AdamW",
        ]
    # Every full-size state tensor of the emerging optimizer is tracked (found in the state).
    # Layer-wise, a rank may own no matrix parameter of one kind: look over all ranks.
    keys = set().union(
        *(rank["facts"].get(INNER[name], {}).get("keys", set()) for rank in offloaded)
    )
    assert keys == STATE_KEYS[name]
    for rank in offloaded:
        for facts in rank["facts"].values():
            assert facts["untracked"] == []


def test_soap_preconditioners_dominate_and_move(rank_pool):
    """SOAP's preconditioners are its largest states: more bytes than its moments here."""
    offloaded = rank_pool.run(emerging_job, "soap", 3, True)
    for rank in offloaded:
        soap = rank["facts"]["SOAP"]
        moments = 2 * 4 * soap["numel"]
        assert soap["state_bytes"] > 2 * moments  # L, R, Q_L, Q_R outweigh exp_avg + exp_avg_sq


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_skipped_step_and_checked_device(rank_pool, name, reference_run):
    """A step skipped by the grad-norm threshold (after the states exist) copies nothing, and
    the whole run holds under the checked stream model (every ordering mistake raises)."""
    reference = reference_run(emerging_job, name, 5, False, skip_at=3)
    offloaded = rank_pool.run(emerging_job, name, 5, True, skip_at=3, checked=True)
    assert_bitwise_equal(reference, offloaded)
    updated = [r["update_successful"] for r in reference[0]["results"]]
    assert updated == [step != 3 for step in range(5)]  # all but the skipped step
    for rank in offloaded:
        assert rank["checked"] == 2  # one checked device per engine
        assert rank["figures"][3]["d2h_copies"] == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_rl_phases(rank_pool, name, reference_run):
    """offloaded() around a rollout, and megatron-core's offload_to_cpu/restore_from_cpu
    (routed to the offloader), between steps; training goes on bitwise."""
    reference = reference_run(emerging_job, name, 4, False, rl_at=1)
    offloaded = rank_pool.run(emerging_job, name, 4, True, rl_at=1)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        assert rank["rl"] == {
            "block_offloaded": True,
            "back_after_block": True,
            "offload_to_cpu_routed": True,
            "restored": True,
        }


# Slots of twice the largest parameter's states: SOAP's [256, 64] matrix keeps its moments,
# L [256, 256], R, Q_L, Q_R (about 0.67 MB); Lion's and Muon's one fp32 buffer (64 KiB),
# AdamW's embedding moments (64 KiB).
CHUNK_BYTES = {"lion": 2 * 70_000, "muon": 2 * 70_000, "soap": 2 * 700_000}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_chunked_update(rank_pool, name, reference_run):
    """The chunked update (states on the host during the step too, streamed through two
    slots): bitwise the whole update, since all three optimizers' math is per parameter."""
    options = {"chunked_update_bytes": CHUNK_BYTES[name]}
    reference = reference_run(emerging_job, name, 4, False)
    offloaded = rank_pool.run(emerging_job, name, 4, True, options=options, checked=True)
    assert_bitwise_equal(reference, offloaded)
    _assert_offloaded_between_steps(offloaded, chunked=True)
    for rank in offloaded:
        assert rank["checked"] == 2
        assert rank["update_chunks"] >= 3  # several chunks, not one whole update


def test_per_optimizer_counts_the_layer_wise_chain_in_order(rank_pool, reference_run):
    """LayerWiseDistributedOptimizer is a chain of its own: per_optimizer's index 1 is its
    second optimizer (AdamW), whose masters then stay on the device; Muon's all go."""
    options = {"per_optimizer": {1: {"offload_master_weights": False}}}
    reference = reference_run(emerging_job, "muon", 3, False, layer_wise=True)
    offloaded = rank_pool.run(emerging_job, "muon", 3, True, layer_wise=True, options=options)
    assert_bitwise_equal(reference, offloaded)
    for rank in offloaded:
        last = rank["figures"][-1]
        assert 0 < last["resident_bytes"] < last["tracked_bytes"]
        assert last["offloaded_bytes"] + last["resident_bytes"] == last["tracked_bytes"]
        # The resident masters are AdamW's: a third of its 12 bytes per parameter.
        adam = rank["facts"]["AdamW"]
        assert last["resident_bytes"] == adam["state_bytes"] // 2
