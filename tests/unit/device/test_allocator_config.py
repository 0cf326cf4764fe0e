"""What the offloader reads of the CUDA caching allocator's configuration (device/allocator.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_offload.device import allocator
from megatron_offload.device.accelerator import AcceleratorDevice
from megatron_offload.device.cpu import CPUDevice

MiB = 1 << 20


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {}),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, {"max_split_size_mb": "128"}),
        ({"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, {"backend": "cudaMallocAsync"}),
        # The CUDA-specific name is read first, as torch does.
        (
            {
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync",
            },
            {"expandable_segments": "True"},
        ),
        (
            {
                "PYTORCH_CUDA_ALLOC_CONF": " Max_Split_Size_MB : 200 , garbage_collection_threshold:0.6,"
            },
            {"max_split_size_mb": "200", "garbage_collection_threshold": "0.6"},
        ),
    ],
)
def test_settings_are_parsed_from_the_environment(environ, expected):
    assert allocator.settings(environ) == expected


def test_piece_bound_keeps_each_segment_under_max_split_size():
    assert allocator.piece_bound({}) is None
    assert allocator.piece_bound({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:160"}) == 158 * MiB
    assert allocator.piece_bound({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:161"}) == 160 * MiB
    # Under cudaMallocAsync there is no split bound: nothing is lowered.
    assert (
        allocator.piece_bound(
            {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,max_split_size_mb:64"}
        )
        is None
    )
    assert allocator.piece_bound({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:lots"}) is None
    for max_split in range(21 * MiB, 600 * MiB, 7 * MiB):
        piece = allocator.splittable_piece_bytes(max_split)
        segment = -(-piece // allocator.SEGMENT_ROUND) * allocator.SEGMENT_ROUND
        assert segment < max_split <= segment + 2 * allocator.SEGMENT_ROUND


def test_the_cuda_device_reads_the_allocator_configuration(monkeypatch):
    # Constructing the device touches no CUDA API when the index is given.
    device = AcceleratorDevice(torch.device("cuda", 0))
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:100")
    assert device.piece_bound() == 98 * MiB and not device.frees_wait_for_copies
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    assert device.piece_bound() is None and device.frees_wait_for_copies
    assert CPUDevice().piece_bound() is None and not CPUDevice().frees_wait_for_copies


def test_the_engine_lowers_its_pieces_to_the_device_bound():
    from megatron_offload.engine import OffloadEngine

    class Bounded(CPUDevice):
        def piece_bound(self):
            return 4096

    tensors = [torch.zeros(3000), torch.zeros(3000)]  # 12,000 bytes each: a piece of its own
    small = [torch.zeros(100) for _ in range(100)]  # 400 bytes each

    def collect():
        for t in tensors + small:
            yield "optimizer_states", t

    engine = OffloadEngine(Bounded(), collect, max_piece_bytes=1 << 20)
    engine.offload()
    stats = engine.stats()
    assert stats["max_piece_bytes"] == 4096
    assert stats["pieces"]["optimizer_states"] > 2
    assert all(g.nbytes <= 4096 or len(g.tensors) == 1 for g in engine.pieces)
    engine.reload()
    engine.wait()
    engine.close()
    unbounded = OffloadEngine(CPUDevice(), collect, max_piece_bytes=1 << 20)
    assert unbounded.stats()["max_piece_bytes"] == 1 << 20
