"""What offloading holds on the host and moves over the link, counted at the device interface.

Every host buffer the package holds comes from its device's ``host_buffer`` and goes back
through ``free_host_buffer``; every byte over the link is a device ``copy``. A counting CPU
device tallies both, independently of ``stats()``, on the real DistributedOptimizer (bf16 GPT
MLP, 2 gloo ranks), in whole mode, in default chunked mode and with the chunked update's
undo (opt-in):

* ``stats()["host_bytes"]`` equals the bytes of host buffers outstanding, in every mode, and so
  does what the one allocator counts (``HostBudget.held``), each buffer once whoever holds it;
* a budget that holds the arena alone refuses the chunked update's first-step staging (it
  counts against ``host_memory_budget`` too), and the step names it;
* whole and default chunked mode hold no more than 1.01x the offloaded bytes on the host, and
  move each offloaded byte once each way per steady step (one copy out, one copy in);
* the undo costs what its documentation says: about twice the host memory, and more copies.
"""

import pytest

STEPS = 4


def accounting_job(mode):
    import megatron_offload
    from megatron_offload.device.cpu import CPUDevice
    from tests.harness import models
    from tests.harness.checkpoints import chunked_options

    class CountingDevice(CPUDevice):
        def __init__(self):
            super().__init__()
            self.outstanding = 0
            self.copied = 0

        def host_buffer(self, nbytes):
            buffer = super().host_buffer(nbytes)
            self.outstanding += buffer.numel()
            return buffer

        def free_host_buffer(self, buffer):
            self.outstanding -= buffer.numel()
            super().free_host_buffer(buffer)

        def copy(self, dst, src):
            self.copied += src.numel() * src.element_size()
            super().copy(dst, src)

    devices = []

    def factory(torch_device):
        devices.append(CountingDevice())
        return devices[-1]

    chunks, optimizer, config = models.build("mlp", "bf16")
    options = {"device_factory": factory}
    if mode != "whole":
        options = chunked_options(optimizer, options)
        options["chunked_update_undo"] = mode == "undo"
    offloader = megatron_offload.attach(optimizer, **options)
    per_step = []
    for step in range(STEPS):
        before = sum(d.copied for d in devices)
        models.train_step(chunks, optimizer, config, step)
        stats = offloader.stats()
        per_step.append(
            {
                "copied": sum(d.copied for d in devices) - before,
                "outstanding": sum(d.outstanding for d in devices),
                "host_bytes": stats["host_bytes"],
                "held": offloader.engines[0].budget.held,
                "offloaded_bytes": stats["offloaded_bytes"],
                "update_chunks": stats["update_chunks"],
            }
        )
    offloader.detach()
    return {"steps": per_step, "after_detach": sum(d.outstanding for d in devices)}


@pytest.mark.parametrize("mode", ["whole", "chunked", "undo"])
def test_host_bytes_are_every_host_buffer_held(rank_pool, mode):
    for rank in rank_pool.run(accounting_job, mode):
        steps = rank["steps"]
        for step in steps:
            assert step["host_bytes"] == step["outstanding"] == step["held"] > 0, (mode, step)
        assert rank["after_detach"] == 0  # every buffer given back
        steady = steps[-1]
        offloaded = steady["offloaded_bytes"]
        assert (steady["update_chunks"] >= 2) == (mode != "whole")
        if mode == "undo":
            assert steady["outstanding"] > 1.5 * offloaded, steady
            assert steady["copied"] > 2 * offloaded, steady
        else:
            # Honest defaults: the arena only, and one copy out and one in of what is offloaded.
            assert steady["outstanding"] <= 1.01 * offloaded, steady
            assert steady["copied"] == 2 * offloaded, steady


def staging_budget_job():
    import megatron_offload
    from megatron_offload.errors import HostMemoryBudgetError
    from tests.harness import models
    from tests.harness.checkpoints import chunked_options

    chunks, optimizer, config = models.build("mlp", "bf16")
    probe = megatron_offload.attach(optimizer, **chunked_options(optimizer, {}))
    arena = probe.stats()["host_bytes"]  # reserved at attach: the arena alone
    probe.detach()
    options = chunked_options(optimizer, {"host_memory_budget": arena})
    offloader = megatron_offload.attach(optimizer, **options)
    try:
        models.train_step(chunks, optimizer, config, 0)
        raised = None
    except HostMemoryBudgetError as error:
        raised = str(error)
    held = offloader.engines[0].budget.held
    offloader.detach()
    return {"arena": arena, "raised": raised, "held": held}


def test_the_chunked_first_steps_staging_counts_against_the_budget(rank_pool):
    for rank in rank_pool.run(staging_budget_job):
        assert rank["arena"] > 0 and rank["raised"] is not None, rank
        assert (
            "staging" in rank["raised"]
            and f"host_memory_budget={rank['arena']:,}" in rank["raised"]
        )
        assert rank["held"] <= rank["arena"], rank  # nothing beyond the budget was allocated
