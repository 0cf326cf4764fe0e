"""Host memory for the states a chunked update's first step creates (``chunked.py``).

At the first step Adam creates its states; the chunked update creates them one parameter per
call and copies them to the host right away, so that even that step never holds more than one
parameter's states beyond the slots. The copies go into few host buffers carved in order,
never one per tensor: every host buffer is pinned, and pinning costs a system call and
page-table work per buffer.
"""

from __future__ import annotations

import torch


class _Staging:
    """Host memory for the states the first step creates: few buffers, carved in order.

    ``estimates[i]``: the bytes the ``i``-th creating parameter's states are expected to
    take (exact for torch's and apex's Adam, a lower bound for Transformer Engine's). The
    first buffer is sized for all of them, so where the estimate is exact one buffer holds
    the step's new states; otherwise each further buffer is at least as large as all before
    it together, so their number grows with the logarithm of the misestimate, not with the
    number of tensors.
    """

    def __init__(self, device, estimates) -> None:
        self.device = device
        self.expected = list(estimates)
        self._remaining = [0] * (len(estimates) + 1)
        for i in range(len(estimates) - 1, -1, -1):  # bytes still expected from parameter i on
            self._remaining[i] = self._remaining[i + 1] + estimates[i]
        self._buffer: torch.Tensor | None = None  # the buffer being carved
        self._used = 0
        self._allocated = 0
        self._kept: set[int] = set()  # ids of buffers the engine took over
        self._open: list[torch.Tensor] = []  # buffers allocated and not taken over yet

    def take(self, nbytes: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(view, buffer)``: ``nbytes`` of host memory (a 16-byte multiple, so every view
        starts aligned for any dtype) and the buffer it is carved from."""
        if self._buffer is None or self._used + nbytes > self._buffer.numel():
            # The buffer left behind stays: earlier states live in it, or copies of the
            # current parameter's states queued just now still write it.
            size = max(nbytes, self._remaining[index], self._allocated)
            self._buffer = self.device.host_buffer(size)
            self._open.append(self._buffer)
            self._allocated += size
            self._used = 0
        view = self._buffer[self._used : self._used + nbytes]
        self._used += nbytes
        return view, self._buffer

    def handed_over(self, buffers) -> None:
        """The engine adopted states living in ``buffers``: it gives them back."""
        self._kept.update(id(buffer) for buffer in buffers)
        self._open = [buffer for buffer in self._open if id(buffer) not in self._kept]

    def free_unused(self) -> None:
        """Give back the buffers no adopted state lives in (the caller has waited for
        every copy into them)."""
        for buffer in self._open:
            self.device.free_host_buffer(buffer)
            if buffer is self._buffer:
                self._buffer = None
        self._open = []
