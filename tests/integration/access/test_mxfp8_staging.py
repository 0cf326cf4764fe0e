"""MXFP8's parameter all-gather staging (prepare_model_params_for_param_sync) reads the host copy of the master weights while they are offloaded: bitwise what a run without offloading stages."""

from __future__ import annotations

import torch


def mxfp8_staging_job(offload):
    """``prepare_model_params_for_param_sync`` (MXFP8 parameter all-gather reusing the gradient
    buffer, with overlapped param gather) copies the fp32 masters into the parameter buffer
    outside the step: served from the host copy while they are offloaded."""
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "mlp", "bf16", overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=1000
    )
    offloader = megatron_offload.attach(optimizer) if offload else None
    for step in range(2):
        models.train_step(chunks, optimizer, config, step)
    models.flush_param_gather(chunks)
    offloaded = offloader.is_offloaded if offload else None
    for owner in (optimizer, *models.distributed_optimizers(optimizer)):
        # What megatron.training sets for the MXFP8 recipe with overlapped param gather.
        owner.config.reuse_grad_buf_for_mxfp8_param_ag = True
        owner.config.overlap_param_gather = True
    before = [
        bucket.param_data.clone()
        for chunk in chunks
        for buffer in chunk.buffers
        for bucket in buffer.buckets
    ]
    for chunk in chunks:
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                bucket.param_data.zero_()  # so that the staging must write every shard
    optimizer.prepare_model_params_for_param_sync()
    buffers = [
        bucket.param_data.clone()
        for chunk in chunks
        for buffer in chunk.buffers
        for bucket in buffer.buckets
    ]
    staged = [b.ne(0).any().item() for b in buffers]
    return {
        "offloaded_before": offloaded,
        "offloaded_after": offloader.is_offloaded if offload else None,
        "buffers": buffers,
        "before": before,
        "staged": staged,
    }


def test_mxfp8_param_staging_reads_the_host_copy_of_the_masters(rank_pool):
    reference = rank_pool.run(mxfp8_staging_job, False)
    offloaded = rank_pool.run(mxfp8_staging_job, True)
    for ref, off in zip(reference, offloaded):
        assert off["offloaded_before"] is True and off["offloaded_after"] is True
        assert len(ref["buffers"]) == len(off["buffers"]) > 0
        assert all(torch.equal(a, b) for a, b in zip(ref["buffers"], off["buffers"]))
        assert any(ref["staged"])  # the staging ran: this rank's shards were written back
