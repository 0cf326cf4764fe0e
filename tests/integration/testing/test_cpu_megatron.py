"""The CPU stand-ins for CUDA that let megatron-core run on CPU ranks (checked in a rank,
where they are installed)."""


def stand_ins_job():
    import torch

    from megatron_offload_testing import cpu_megatron

    stream = torch.cuda.Stream()
    event = torch.cuda.Event(enable_timing=True)
    with stream:
        stream.wait_stream(torch.cuda.current_stream())
        stream.wait_event(event)
        recorded = stream.record_event()
    event.record(stream)
    event.wait(stream)
    event.synchronize()
    stream.synchronize()
    t = torch.zeros(3)
    return {
        "installed": cpu_megatron.is_installed(),
        "queries": (stream.query(), event.query(), recorded.query()),
        "elapsed": event.elapsed_time(recorded),
        "type": t.type(),
        "type_cast": t.type("torch.cuda.HalfTensor").dtype == torch.float16,
        "type_dtype": t.type(dtype="torch.cuda.BFloat16Tensor").dtype == torch.bfloat16,
        "cuda": t.cuda() is t,
        "to": t.to("cuda").device.type,
        "zeros": torch.zeros(2, device="cuda").device.type,
        "available": (torch.cuda.is_available(), torch.accelerator.is_available()),
    }


def test_cuda_stand_ins_behave_as_a_cpu_would(rank_pool):
    found = rank_pool.run(stand_ins_job)[0]
    assert found["installed"] and found["queries"] == (True, True, True)
    assert found["elapsed"] == 0.0
    assert found["type"] == "torch.cuda.FloatTensor"  # what megatron-core checks for
    assert found["type_cast"] and found["type_dtype"] and found["cuda"]
    assert found["to"] == found["zeros"] == "cpu"
    assert found["available"] == (False, False)  # the offloader still sees a CPU machine
