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
        # The device as a keyword, a torch.device and a bare index.
        "keyword": (
            t.to(device="cuda:0").device.type,
            torch.empty(1, device=torch.device("cuda")).device.type,
            torch.ones(1, device=0).device.type,
        ),
        "available": (torch.cuda.is_available(), torch.accelerator.is_available()),
    }


def test_cuda_stand_ins_behave_as_a_cpu_would(rank_pool):
    found = rank_pool.run(stand_ins_job)[0]
    assert found["installed"] and found["queries"] == (True, True, True)
    assert found["elapsed"] == 0.0
    assert found["type"] == "torch.cuda.FloatTensor"  # what megatron-core checks for
    assert found["type_cast"] and found["type_dtype"] and found["cuda"]
    assert found["to"] == found["zeros"] == "cpu"
    assert found["keyword"] == ("cpu", "cpu", "cpu")
    assert found["available"] == (False, False)  # the offloader still sees a CPU machine


def _fused(x):
    return x * 2


def compile_job():
    import torch
    from megatron.core import jit

    return {
        "compile": torch.compile(_fused) is _fused,
        "factory": torch.compile(mode="max-autotune", fullgraph=True)(_fused) is _fused,
        # Bound when megatron-core was imported, after install() in the rank.
        "jit_fuser": jit.jit_fuser(_fused) is _fused,
    }


def test_compiled_helpers_are_the_functions_themselves(rank_pool):
    """Compilation is off on CPU ranks, so megatron-core's ``torch.compile``-wrapped helpers
    only ever ran eagerly; ``install()`` makes ``torch.compile`` hand the function back, and
    building no wrapper imports neither dynamo nor inductor (2 s of a core in each process
    that imports megatron-core: docs/testing.md)."""
    found = rank_pool.run(compile_job)
    assert all(rank == {"compile": True, "factory": True, "jit_fuser": True} for rank in found)
