"""attach's stream_priority reaches the device layer, on the real optimizer (gloo ranks)."""

from __future__ import annotations


# ------------------------------------------------------- attach keyword (real optimizer, gloo)
def priority_job(priority):
    import megatron_offload
    from megatron_offload.offloader import members as offloader_module
    from tests.harness import models

    chunks, optimizer, config = models.build("mlp", "bf16")
    seen = []
    real = offloader_module.device_for

    def recording_device_for(torch_device, **kwargs):
        seen.append(kwargs)
        return real(torch_device, **kwargs)

    offloader_module.device_for = recording_device_for
    try:
        offloader = megatron_offload.attach(optimizer, stream_priority=priority)
    finally:
        offloader_module.device_for = real
    models.train_step(chunks, optimizer, config, 0)
    offloader.reload()
    offloader.wait()
    offloader.detach()
    return seen


def test_attach_passes_the_priority_to_the_device_layer(rank_pool):
    for seen in rank_pool.run(priority_job, -4):
        assert seen == [{"stream_priority": -4}]
