"""Faults injected at the boundary with torch: a device allocation that fails, an update that
raises part-way. Nothing of the package is patched: these replace torch's own entry points for
the duration of a block, as a device out of memory or a failing kernel would answer."""

from __future__ import annotations

import torch

_OOM = "CUDA out of memory. Tried to allocate {} bytes (injected)"


class AllocationFaults:
    """Inside the block, storage allocations are counted (a storage regrown with ``resize_``,
    a fresh ``torch.empty``), and the ``fail_at``-th (from 1; None: none) raises
    ``torch.OutOfMemoryError`` instead of allocating, as a full device does."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.count = 0
        self._saved = None

    def _allocation(self, nbytes: int) -> None:
        self.count += 1
        if self.count == self.fail_at:
            raise torch.OutOfMemoryError(_OOM.format(nbytes))

    def __enter__(self) -> "AllocationFaults":
        resize, empty = torch.UntypedStorage.resize_, torch.empty
        self._saved = resize, empty
        faults = self

        def resize_(storage, nbytes):
            if nbytes > storage.nbytes():
                faults._allocation(nbytes)
            return resize(storage, nbytes)

        def empty_(*args, **kwargs):
            faults._allocation(-1)
            return empty(*args, **kwargs)

        torch.UntypedStorage.resize_ = resize_
        torch.empty = empty_
        return self

    def __exit__(self, *exc) -> None:
        torch.UntypedStorage.resize_, torch.empty = self._saved


class FailingUpdate:
    """Inside the block, the ``fail_at``-th in-place ``addcdiv_`` (the last operation of Adam's
    update of one parameter, in torch's single-tensor AdamW) raises: an update that stops
    part-way, some parameters updated and the rest not."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.count = 0

    def __enter__(self) -> "FailingUpdate":
        self._saved = torch.Tensor.addcdiv_
        saved, faults = self._saved, self

        def addcdiv_(tensor, *args, **kwargs):
            faults.count += 1
            if faults.count == faults.fail_at:
                raise RuntimeError("the update failed part-way (injected)")
            return saved(tensor, *args, **kwargs)

        torch.Tensor.addcdiv_ = addcdiv_
        return self

    def __exit__(self, *exc) -> None:
        torch.Tensor.addcdiv_ = self._saved
