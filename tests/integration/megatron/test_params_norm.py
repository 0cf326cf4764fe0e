"""``--log-params-norm`` with offloading: only what megatron's ``calc_params_l2_norm`` reads
comes back for it.

The norm reads the fp32 master shards megatron-core keeps beside the DistributedOptimizer
(``param.main_param``), never Adam's moments. ``master_weights_residency`` (what the patched
``calc_params_l2_norm`` and the source patches run it under) must therefore copy back exactly
the masters' bytes and no moment byte, leave the moments released while the norm runs, and
offload the masters again afterwards without copying them out. On the precision-aware path
(TE FusedAdam double) ``main_param`` is None and the masters live in the optimizer state:
nothing comes back at all.

Each job runs the real megatron-core DDP + DistributedOptimizer and megatron's own
``calc_params_l2_norm`` on gloo CPU ranks; the norm and the training after it must be bitwise
those of the run without offloading. The negative control brings back everything (the old
behaviour, ``resident()`` without ``kinds``) around the same norm: the counter sees the moments
then, so its zero is not blind.
"""

import argparse
import contextlib

from tests.harness.compare import assert_bitwise_equal
from tests.harness.optimizer_jobs import piece_places
from tests.harness.training_args import offload_args


def _count_copies(offloader):
    """Tally every copy the offloader's engines make, by direction and kind of the group,
    at their device (where every copy of the engine goes)."""
    tally = {}
    devices = {id(engine.device): engine.device for engine in offloader.engines}
    for device in devices.values():
        copy = device.copy

        def counted(dst, src, copy=copy):
            for engine in offloader.engines:
                for group in engine.pieces:
                    if group.flat is not None and (group.flat is src or group.flat is dst):
                        key = ("d2h" if group.flat is src else "h2d", group.kind)
                        tally[key] = tally.get(key, 0) + src.numel() * src.element_size()
            return copy(dst, src)

        device.copy = counted
    return tally


def norm_job(offload: bool, precision_aware: bool = False, steps: int = 3):
    from megatron.training.utils import common_utils

    from megatron_offload.adapters import MASTER_WEIGHTS, OPTIMIZER_STATES
    from megatron_offload.megatron import training as hooks
    from tests.harness import models, optimizer_jobs

    injected = optimizer_jobs.injected("te") if precision_aware else contextlib.nullcontext()
    overrides = optimizer_jobs.precision_aware(True, "fp32") if precision_aware else {}
    original_get_args = common_utils.get_args
    common_utils.get_args = lambda: argparse.Namespace(bf16=True, use_megatron_fsdp=False)
    report = {}
    try:
        with injected:
            chunks, optimizer, config = models.build("mlp", "bf16", optimizer_overrides=overrides)
            args = offload_args(offload_optimizer_states=offload, offload_release_master_grads=True)
            offloader = hooks.attach_for_training(optimizer, args)
            results = [models.train_step(chunks, optimizer, config, step) for step in range(steps)]
            inside = []

            def calc_params_l2_norm(model):  # megatron's, noting what is on the device
                if offloader is not None:
                    inside.append(piece_places(offloader))
                return common_utils.calc_params_l2_norm(model)

            # What patch_megatron() installs as training.calc_params_l2_norm.
            patched = hooks._wrap_params_norm(calc_params_l2_norm)
            if offloader is None:
                report["norm"] = patched(chunks)
            else:
                report["before"] = piece_places(offloader)
                tally = _count_copies(offloader)
                report["norm"] = patched(chunks)
                report["tally"], report["inside"] = dict(tally), inside[0]
                report["after"] = piece_places(offloader)
                sizes = {}
                for engine in offloader.engines:
                    for group in engine.pieces:
                        sizes[group.kind] = sizes.get(group.kind, 0) + group.nbytes
                report["masters_bytes"] = sizes.get(MASTER_WEIGHTS, 0)
                report["moments_bytes"] = sizes.get(OPTIMIZER_STATES, 0)
                # Negative control: everything back around the same norm (the old behaviour).
                tally.clear()
                with offloader.resident(read_only=True):
                    report["control_norm"] = common_utils.calc_params_l2_norm(chunks)
                report["control_tally"] = dict(tally)
            results.append(models.train_step(chunks, optimizer, config, steps))
            report["results"] = results
            report["snapshot"] = models.final_snapshot(chunks, optimizer, offloader)
            if offloader is not None:
                offloader.detach()
    finally:
        common_utils.get_args = original_get_args
    return report


def _assert_bitwise(reference, offloaded):
    for ref, off in zip(reference, offloaded):
        assert ref["norm"] == off["norm"] == off["control_norm"]
    # Loss and grad norm, including the step after; parameters and states.
    assert_bitwise_equal(reference, offloaded)


def test_params_norm_reloads_only_the_master_weights(rank_pool):
    reference = rank_pool.run(norm_job, False)
    offloaded = rank_pool.run(norm_job, True)
    _assert_bitwise(reference, offloaded)
    for rank in offloaded:
        assert rank["norm"] > 0  # megatron's norm really read the masters
        masters, moments = rank["masters_bytes"], rank["moments_bytes"]
        assert masters > 0 and moments == 2 * masters  # fp32 masters, two fp32 moments
        # Exactly the masters' bytes came back, no moment byte, and nothing was copied out
        # again afterwards (read-only: the host copy stayed valid).
        assert rank["tally"] == {("h2d", "master_weights"): masters}
        assert (
            rank["before"]
            == rank["after"]
            == {"master_weights": {"released"}, "optimizer_states": {"released"}}
        )
        # While the norm ran: the masters on the device, the moments still on the host.
        assert rank["inside"] == {"master_weights": {"resident"}, "optimizer_states": {"released"}}
        # Negative control: bringing everything back moves the moments too, and the counter
        # sees them.
        assert rank["control_tally"] == {
            ("h2d", "master_weights"): masters,
            ("h2d", "optimizer_states"): moments,
        }


def test_params_norm_reloads_nothing_on_the_precision_aware_path(rank_pool):
    """TE FusedAdam with master weights: ``main_param`` is None, the masters (``master_param``,
    here int16 remainders) live in the optimizer state and the norm does not read them
    (megatron-core 0.19.2 then reports a params norm of 0, with or without offloading)."""
    reference = rank_pool.run(norm_job, False, True)
    offloaded = rank_pool.run(norm_job, True, True)
    _assert_bitwise(reference, offloaded)
    for rank in offloaded:
        assert rank["masters_bytes"] > 0 and rank["moments_bytes"] > 0
        assert rank["tally"] == {}
        assert (
            rank["inside"]
            == rank["before"]
            == rank["after"]
            == {"master_weights": {"released"}, "optimizer_states": {"released"}}
        )
        assert rank["control_tally"] == {
            ("h2d", "master_weights"): rank["masters_bytes"],
            ("h2d", "optimizer_states"): rank["moments_bytes"],
        }
