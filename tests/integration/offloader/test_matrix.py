"""The correctness matrix: offloading on vs off, bitwise, across Megatron's training modes.

Dimensions: dtype (fp32, bf16, fp16 with dynamic loss scaling, whose first steps overflow
and are skipped) x layout (DP=2, DP=4, TP=2 x DP=2, PP=2 x DP=2, PP=2 with two virtual
stages per rank, MoE with expert parallelism: a ChainedOptimizer of a dense and an expert
DistributedOptimizer) x overlap
(none, grad reduce, grad reduce + param gather) x gradient accumulation (1 or 2
micro-batches) x model (MLP, GPT). Each (layout, dtype) pair appears, and the overlap and
accumulation settings rotate through them so every value of every dimension is covered
several times; the size is printed at the end of the test run.

Every case also skips one step in the middle (grad-norm threshold), after the moments
exist, and checks that the skipped step copied nothing. The offloaded runs use pieces of
``PIECE`` bytes (far below the default), so every group of the test models is split into
several device storages, each copied and released on its own. Planted bugs (negative controls)
show that the comparison catches a broken offloader.
"""

import itertools

import pytest
import torch

LAYOUTS = {
    # name: (world size, run() options, build() options)
    "dp2": (2, {}, {}),
    "dp4": (4, {}, {}),
    "tp2": (4, {"tp": 2}, {}),
    "pp2": (4, {"pp": 2}, {}),
    # Interleaved (virtual) pipeline: two model chunks per stage, one DistributedOptimizer
    # over both; 4 micro-batches so the interleaved schedule has work for every chunk.
    "vpp2": (
        4,
        {"pp": 2, "mp_kwargs": {"virtual_pipeline_model_parallel_size": 2}},
        {"num_layers": 4},
    ),
}
OVERLAPS = [(False, False, None), (True, False, 1000), (True, True, 1000)]
STEPS, SKIP_AT = 6, 4
PIECE = 8 << 10  # max_piece_bytes of the matrix: every group of the test models is split


def _cases():
    cases = []
    rotation = itertools.cycle(itertools.product(OVERLAPS, (1, 2)))
    models = itertools.cycle(("mlp", "gpt"))
    for layout, dtype in itertools.product(LAYOUTS, ("fp32", "bf16", "fp16")):
        (ogr, opg, bucket), micro = next(rotation)
        model = next(models)
        if layout in ("pp2", "vpp2"):
            model = "mlp"  # keeps 4-rank pipeline cases short; GPT runs PP in the functional tests
        if layout == "vpp2":
            micro = 4
        cases.append((layout, dtype, model, ogr, opg, bucket, micro))
    for dtype, (ogr, opg, bucket) in (
        ("bf16", OVERLAPS[2]),
        ("fp32", OVERLAPS[1]),
        ("fp16", OVERLAPS[0]),
    ):
        cases.append(("moe", dtype, "gpt", ogr, opg, bucket, 2))
    return cases


CASES = _cases()


def _build_options(layout, dtype, model, ogr, opg, bucket):
    options = dict(
        overlap_grad_reduce=ogr,
        overlap_param_gather=opg,
        bucket_size=bucket if model == "mlp" else (bucket and 3 * bucket),
    )
    if dtype == "fp16":  # the first steps overflow and are skipped by the loss scaler
        options["optimizer_overrides"] = {"initial_loss_scale": 2.0**24, "hysteresis": 1}
    if layout == "moe":
        from tests.harness import models

        options["transformer_overrides"] = dict(models.MOE)
    options.update(LAYOUTS.get(layout, (0, {}, {}))[2])
    return options


def matrix_job(
    layout,
    dtype,
    model,
    ogr,
    opg,
    bucket,
    micro,
    *,
    offload,
    plant=None,
    options=None,
    checked=False,
):
    import megatron_offload
    from megatron_offload.adapters import megatron_wrappers as adapter
    from tests.harness import models
    from tests.harness.checked import check_devices, checked_device_options

    # A plant is undone when the job ends, so the rank processes stay clean for the next test.
    undo = _plant(plant) if plant else None
    try:
        devices = []
        if checked:
            options, devices = checked_device_options(options)
        chunks, optimizer, config = models.build(
            model, dtype, **_build_options(layout, dtype, model, ogr, opg, bucket)
        )
        offloader = megatron_offload.attach(optimizer, **(options or {})) if offload else None
        distributed = models.distributed_optimizers(optimizer)
        results, figures = [], []
        for step in range(STEPS):
            skip = step == SKIP_AT
            if skip:  # a step skipped by the grad-norm threshold, as ChainedOptimizer does
                for distrib in distributed:
                    distrib.config.grad_norm_skip_threshold = 0.0
            results.append(models.train_step(chunks, optimizer, config, step, micro))
            if skip:
                for distrib in distributed:
                    distrib.config.grad_norm_skip_threshold = float("inf")
            if offloader:
                stats = offloader.stats()
                sizes = [
                    t.untyped_storage().nbytes()
                    for index, d in enumerate(distributed)
                    for kind, t in adapter.collect(d)
                    if kind in offloader.config.kinds(index)
                ]
                figures.append(
                    {
                        "offloaded": stats["offloaded_bytes"],
                        "d2h": stats["d2h_copies"],
                        "held": sum(sizes),
                        "host": stats["host_bytes"],
                        "tracked": stats["tracked_bytes"],
                        "pieces": stats["pieces"],
                        "largest_piece": stats["largest_piece_bytes"],
                        "groups": _groups_per_kind(offloader),
                        "largest_tensor": max(
                            t.numel() * t.element_size()
                            for e in offloader.engines
                            for g in e.pieces
                            for t in g.tensors
                        ),
                    }
                )
        snapshot = models.final_snapshot(chunks, optimizer, offloader)
        check_devices(devices)
        return {
            "results": results,
            "figures": figures,
            "snapshot": snapshot,
            "optimizers": len(distributed),
            "checked": len(devices),
        }
    finally:
        if undo is not None:
            undo()


def _groups_per_kind(offloader):
    """(kind, dtype) groups per kind: what the pieces split."""
    counts = {}
    for engine in offloader.engines:
        for kind in {(g.kind, g.dtype) for g in engine.pieces}:
            counts[kind[0]] = counts.get(kind[0], 0) + 1
    return counts


def _plant(bug):
    """Test-only sabotage of the offloader in this rank process (negative controls); returns
    the function that undoes it."""
    from megatron_offload.engine import Place
    from megatron_offload.engine.protocol import CopyProtocol

    # Planted on the protocol's class: every engine made from now on takes its moves from it.
    cls = CopyProtocol
    saved = {name: cls.__dict__[name] for name in ("mark_dirty", "reload")}

    def undo():
        for name, value in saved.items():
            setattr(cls, name, value)

    if bug == "stale-host-copy":
        # The step no longer marks the host copy stale: later cycles keep the first copy.
        cls.mark_dirty = lambda self, *args, **kwargs: None
    elif bug == "reload-drops-a-tensor":
        original = cls.reload

        def reload(self, *args, **kwargs):
            released = [g for g in self.pieces if g.place is Place.RELEASED]
            original(self, *args, **kwargs)
            for group in released:  # the copy-back (synchronous here) loses the first element
                if group.place is not Place.RELEASED:
                    group.flat.view(-1)[:1].zero_()

        cls.reload = reload
    else:
        raise ValueError(bug)
    return undo


def _run_ranks(pool, pool4, case, **kw):
    layout = case[0]
    world, run_options, _ = LAYOUTS.get(layout, (2, {"ep": 2}, {}))
    target = pool if world == 2 else pool4
    return target.run(matrix_job, *case, **kw, **run_options)


def _compare(reference, offloaded):
    mismatches = []
    for rank, (ref, off) in enumerate(zip(reference, offloaded)):
        if ref["results"] != off["results"]:
            mismatches.append((rank, "results"))
        for section in ("params", "optimizer"):
            a, b = ref["snapshot"][section], off["snapshot"][section]
            mismatches += [(rank, section, k) for k in a if not torch.equal(a[k], b[k])]
    return mismatches


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_matrix_offloading_is_bitwise_invisible(rank_pool, request, case):
    pool4 = request.getfixturevalue("rank_pool4") if LAYOUTS.get(case[0], (2,))[0] == 4 else None
    reference = _run_ranks(rank_pool, pool4, case, offload=False)
    offloaded = _run_ranks(rank_pool, pool4, case, offload=True, options={"max_piece_bytes": PIECE})
    assert _compare(reference, offloaded) == []
    layout, dtype = case[0], case[1]
    for ref, off in zip(reference, offloaded):
        if layout == "moe":
            assert off["optimizers"] == 2  # dense + expert DistributedOptimizers
        skipped = [not r["update_successful"] for r in ref["results"]]
        assert skipped[SKIP_AT]
        if dtype == "fp16":
            assert skipped[0]  # the loss scaler's overflow skips
        for step, figures in enumerate(off["figures"]):
            assert figures["held"] == 0 and figures["offloaded"] == figures["tracked"] > 0
            # The host holds what is tracked; until a step made the states (fp16 overflows
            # skip the first ones), the arena reserved for them at attach holds the masters.
            if all(skipped[: step + 1]):
                assert figures["host"] > figures["tracked"]
            else:
                assert figures["host"] == figures["tracked"]
            # Every group is split, and a piece exceeds the bound only as a single tensor.
            for kind, groups in figures["groups"].items():
                assert figures["pieces"][kind] > groups, (kind, figures)
            assert figures["largest_piece"] <= max(PIECE, figures["largest_tensor"])
            if step == STEPS - 1 and not skipped[step]:  # consolidated by then: one copy per piece
                assert figures["d2h"] == sum(figures["pieces"].values())
            if step == SKIP_AT or (step > 0 and skipped[step] and skipped[step - 1]):
                assert figures["d2h"] == 0, step  # nothing changed: no needless copy


@pytest.mark.parametrize("plant", ["stale-host-copy", "reload-drops-a-tensor"])
def test_planted_bug_makes_the_matrix_fail(rank_pool, plant, reference_run):
    """Negative control: a broken offloader must not pass the comparison above."""
    case = ("dp2", "bf16", "mlp", True, False, 1000, 1)
    reference = reference_run(matrix_job, *case, offload=False)
    sabotaged = rank_pool.run(matrix_job, *case, offload=True, plant=plant)
    assert _compare(reference, sabotaged) != []
    # The job undid its plant: the same rank processes train correctly again.
    assert _compare(reference, rank_pool.run(matrix_job, *case, offload=True)) == []


def test_per_optimizer_selection_in_a_moe_model(rank_pool, reference_run):
    """Keep the expert optimizer's masters on the device, offload everything else."""
    case = ("moe", "bf16", "gpt", True, True, 1000, 1)
    options = {"per_optimizer": {1: {"offload_master_weights": False}}}
    reference = reference_run(matrix_job, *case, offload=False, ep=2)
    offloaded = rank_pool.run(matrix_job, *case, offload=True, options=options, ep=2)
    assert _compare(reference, offloaded) == []
    for off in offloaded:
        last = off["figures"][-1]
        assert last["held"] == 0  # everything selected is released...
        assert 0 < last["offloaded"] < last["tracked"]  # ... and the expert masters stayed


@pytest.mark.parametrize(
    "case",
    [("dp2", "fp16", "mlp", True, True, 1000, 2), ("moe", "bf16", "gpt", True, False, 1000, 1)],
)
def test_matrix_cases_under_the_checked_stream_model(rank_pool, case, reference_run):
    """Skipped steps (loss scaler and grad-norm), overlaps, accumulation and a chained MoE
    optimizer with side streams deferred and fresh memory poisoned: any missing wait
    raises in the ranks or corrupts the comparison."""
    extra = {"ep": 2} if case[0] == "moe" else {}
    reference = reference_run(matrix_job, *case, offload=False, **extra)
    checked = rank_pool.run(
        matrix_job, *case, offload=True, checked=True, options={"max_piece_bytes": PIECE}, **extra
    )
    assert _compare(reference, checked) == []
    assert all(rank["checked"] == rank["optimizers"] for rank in checked)
