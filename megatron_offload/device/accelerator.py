"""Accelerator device (CUDA and other torch accelerators with streams and events).

This is the only module that issues asynchronous work. It is written against the
generic torch device module (``torch.get_device_module``), so the same code serves
CUDA and other stream-based accelerators; the CUDA-specific parts are the exact-size
pinning of host buffers (see ``host_buffer``: pages faulted in by several threads, one
registration, explicit unregistration in ``free_host_buffer``; the CUDA-free logic is in
``pinned.py``) and the private side streams (see ``private_cuda_stream``).

Nothing here runs in CI (there is no accelerator there): keep it small and obvious.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from . import allocator, numa, pinned
from .base import Device


class AcceleratorDevice(Device):
    """Streams, events and non-blocking copies on one accelerator."""

    is_accelerator = True

    def __init__(self, torch_device: torch.device, *, stream_priority: int = 0) -> None:
        if torch_device.index is None:
            module = torch.get_device_module(torch_device.type)
            torch_device = torch.device(torch_device.type, module.current_device())
        self.torch_device = torch_device
        self._module = torch.get_device_module(torch_device.type)
        #: Priority of the side streams (``OffloadConfig.stream_priority``).
        self.stream_priority = stream_priority
        # Buffers this device pinned, by address: (buffer, registered ranges). Holding the
        # buffer here keeps its memory alive until ``free_host_buffer`` unregisters it, so
        # pinned memory is never handed back to the allocator by the garbage collector.
        self._pinned: dict[int, tuple[torch.Tensor, tuple[tuple[int, int], ...]]] = {}
        #: The NUMA node host buffers are bound to (``numa.py``), found at the first one.
        self.placement: numa.Placement | None = None
        #: Whether the last host buffer's pages were bound to that node, and if not, why.
        self.numa_bound = False
        self.numa_note = ""
        self._fallback_said = False  # the pageable fallback warns once per device

    # ----------------------------------------------------------------- memory
    def piece_bound(self) -> int | None:
        return allocator.piece_bound() if self.torch_device.type == "cuda" else None

    @property
    def frees_wait_for_copies(self) -> bool:
        return self.torch_device.type == "cuda" and allocator.backend() == "cudaMallocAsync"

    #: What a failed pin does: False (the default) raises a clear error; True warns (once)
    #: and returns pageable memory, whose copies are then synchronous with the host
    #: (``attach`` sets it unless ``require_pinned_memory``).
    pageable_fallback = False
    #: False: host buffers are pageable from the start (the node check found ``ulimit -l``
    #: too low for what this rank would pin, and warned).
    pinning = True
    #: Threads that fault in the pages of a new host buffer (``pinned.pin``).
    pin_threads = pinned.DEFAULT_THREADS

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Mapped shared, so that a fork after attach copies none of the pinned pages
        # (pinned.shared_host_buffer).
        return self._pinned_buffer(nbytes, pinned.shared_host_buffer)

    def io_buffer(self, nbytes: int) -> torch.Tensor:
        # The same, pinned, over a mapping in huge pages that a fork wipes
        # (pinned.io_host_buffer).
        return self._pinned_buffer(nbytes, pinned.io_host_buffer)

    def _pinned_buffer(self, nbytes: int, mapped) -> torch.Tensor:
        """``nbytes`` of the mapping ``mapped(span)`` makes, pinned (see ``host_buffer``)."""
        if self.torch_device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
        # torch's pinned-memory allocator rounds every request up to a power of two (up to
        # 2x the host RAM for one large arena). Registering an exactly sized pageable buffer
        # pins what is asked for, rounded to whole pages, in a mapping of its own (no page
        # shared with another allocation or registration).
        page = pinned.page_size()
        span = -(-nbytes // page) * page
        whole = mapped(span)
        buffer = whole[:nbytes]
        if not nbytes or not self.pinning:
            return buffer
        # Bound to the accelerator's NUMA node before any page is touched (numa.py).
        place = self._placement()
        self.numa_note = place.note or numa.bind(whole.data_ptr(), span, place.node)
        self.numa_bound = place.binds and not self.numa_note
        register, unregister = _host_register_calls()
        module, torch_device = self._module, self.torch_device

        def register_here(address: int, size: int) -> int:
            # The current device is per thread: each pinning thread makes the arena's
            # device current, so the memory is registered with that device's context.
            with module.device(torch_device):
                return register(address, size)

        def unregister_here(address: int) -> int:
            with module.device(torch_device):
                return unregister(address)

        try:
            ranges = pinned.pin(
                whole,
                register=register_here,
                unregister=unregister_here,
                threads=self.pin_threads,
                cpus=place.cpus if self.numa_bound else (),
            )
        except pinned.PinError as error:
            # A failed cudaHostRegister leaves the error as CUDA's last error, where the next
            # unrelated error check (torch's, after any kernel) would report it.
            _clear_cuda_error()
            message = (
                f"pinning {nbytes:,} bytes of host memory for {self.torch_device} failed "
                f"(cudaHostRegister error {error.code}): the host may be out of lockable memory "
                "(check `ulimit -l` and the container's memlock limit) or of memory; lower the "
                "host-memory need (offload_fraction, per_optimizer, offload_master_weights=False)"
            )
            if not self.pageable_fallback:
                raise RuntimeError(
                    message + ", or let it fall back to pageable memory "
                    "(require_pinned_memory=False, AcceleratorDevice.pageable_fallback)."
                ) from error
            if not self._fallback_said:
                warnings.warn(
                    message + ". Falling back to pageable memory: every copy to or from it is "
                    "synchronous with the host, so offloading no longer overlaps computation "
                    "(require_pinned_memory=True refuses instead).",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._fallback_said = True
            return buffer
        self._pinned[buffer.data_ptr()] = (whole, ranges)  # the mapping stays until unregistered
        return buffer

    def _placement(self) -> numa.Placement:
        if self.placement is None:
            try:
                props = self._module.get_device_properties(self.torch_device)
                bus_id = (
                    f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
                )
            except (AttributeError, RuntimeError, TypeError):
                bus_id = None
            self.placement = numa.placement(bus_id)
        return self.placement

    def free_host_buffer(self, buffer: torch.Tensor) -> None:
        """Unregister a buffer from ``host_buffer``; safe to call again, or on a buffer that
        fell back to pageable memory (nothing is registered then)."""
        entry = self._pinned.pop(buffer.data_ptr(), None) if buffer.numel() else None
        if entry is None:
            return
        _, ranges = entry
        _, unregister = _host_register_calls()
        # cudaHostUnregister must run with the device current that registered the memory,
        # whatever device the caller (a finalizer, another rank's thread) has current.
        with self._module.device(self.torch_device):
            codes = pinned.unpin(ranges, unregister)
        if any(codes):
            _clear_cuda_error()
            warnings.warn(
                f"cudaHostUnregister of a host buffer of {buffer.numel():,} bytes failed "
                f"(error {next(c for c in codes if c)}); the memory stays locked until the process exits.",
                RuntimeWarning,
                stacklevel=2,
            )

    # ---------------------------------------------------------------- streams
    def current_stream(self):
        return self._module.current_stream(self.torch_device)

    def new_stream(self):
        """A side stream of this offloader's own, on its device (see ``private_cuda_stream``);
        where none can be made, one from torch's shared pool, with a one-time warning."""
        stream, reason = private_cuda_stream(self._module, self.torch_device, self.stream_priority)
        if stream is not None:
            return stream
        _warn_shared_pool(reason)
        return self._module.Stream(device=self.torch_device, priority=self.stream_priority)

    def retire_stream(self, stream, *, announced: bool) -> None:
        if announced:
            # Memory still names this stream in its record_stream set: never destroy it (the
            # wrapper is held until exit, as torch holds its own pool's streams).
            _RETAINED_STREAMS.append(stream)

    def use_stream(self, stream):
        return self._module.stream(stream)

    def wait_stream(self, waiter, waitee, *, label="") -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream, *, timing=False):
        event = self._module.Event(enable_timing=timing)
        event.record(stream)
        return event

    def elapsed_ms(self, start, end):
        # query() never blocks: a measurement whose copies are still running is read later.
        if not end.query():
            return None
        return start.elapsed_time(end)

    def wait_event(self, stream, event, *, label="") -> None:
        stream.wait_event(event)

    def synchronize_event(self, event, *, label="") -> None:
        event.synchronize()

    def record_stream(self, tensor, stream, *, label="") -> None:
        tensor.record_stream(stream)

    def copy(self, dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def synchronize(self) -> None:
        self._module.synchronize(self.torch_device)

    def memory_allocated(self):
        return self._module.memory_allocated(self.torch_device)

    def pinned_bytes(self) -> int:
        return sum(whole.numel() for whole, _ in self._pinned.values())

    def memory_free(self):
        try:
            return int(self._module.mem_get_info(self.torch_device)[0])
        except Exception:  # noqa: BLE001 - a figure for a message, never a second failure
            return None


def current_device(device_type: str | None = None) -> torch.device:
    """The current device of the accelerator (``torch.accelerator``'s type by default)."""
    if device_type is None:
        accelerator = getattr(torch, "accelerator", None)
        found = accelerator.current_accelerator() if accelerator is not None else None
        device_type = found.type if found is not None else "cuda"
    module = torch.get_device_module(device_type)
    return torch.device(device_type, module.current_device())


# ------------------------------------------------------------------ private side streams
# Why the side streams are created here and not with ``torch.cuda.Stream()``: that constructor
# (torch/csrc/cuda/Stream.cpp, THCPStream_pynew) returns ``c10::cuda::getStreamFromPool``,
# a round-robin pick among 32 streams per device and priority that torch creates once
# (c10/cuda/CUDAStream.cpp), and ProcessGroupNCCL takes its collective streams from the same
# pool (``getStreamFromPool(is_high_priority_stream)``). An offloader copy and a parameter
# all-gather or gradient reduce-scatter can therefore land on one CUDA stream, where the
# collective queues behind a D2H of gigabytes. torch (2.13) has no constructor for a stream
# outside the pool; it wraps a stream someone else made with ``torch.cuda.ExternalStream``
# (``getStreamFromExternal``), which does not own it. ``torch.cuda.cudart()`` does bind
# ``cudaStreamCreate``, but that makes a *blocking* stream, which synchronizes with the legacy
# default stream that Megatron computes on, so the copies would no longer overlap anything.
#
# So: cuda-python's ``cudaStreamCreateWithPriority(cudaStreamNonBlocking, priority)`` (the
# call and flags torch uses for its pool), with the optimizer's device current, wrapped in
# ``torch.cuda.ExternalStream``. torch never hands that stream to anyone else, so it is
# private to the offloader. Without cuda-python, on ROCm or other accelerators, or if the call
# fails, ``AcceleratorDevice.new_stream`` falls back to a pooled stream (with the same
# priority) and warns once per process: correct, just shareable.
#
# Lifetime: the stream belongs to its ExternalStream wrapper, which the engine keeps for its
# whole life. When the last reference goes (the offloader was detached and dropped), a
# finalizer first waits until everything queued on the stream has run, then destroys it.
# The caching allocator records an event on every stream a block was announced to with
# ``record_stream`` when that block is freed. The engine frees the blocks it announces (rule
# 2); where one outlives the engine (a storage another owner shares, states offloaded and
# never released), the engine's close says so (``retire_stream(announced=True)``) and the
# stream is kept until the process exits. At interpreter exit the
# stream is not destroyed (as torch leaks its pool): the CUDA runtime may already be gone,
# and the driver reclaims it with the process.

_shared_pool_warned = False
# Private streams some live memory was announced to when their engine closed (``retire_stream``).
_RETAINED_STREAMS: list = []


def _cuda_runtime():
    """cuda-python's runtime bindings (``cuda.bindings.runtime``; ``cuda.cudart`` before
    cuda-python 12.6), or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart

        return cudart
    except ImportError:
        return None


def _host_register_calls():
    """``(register(address, nbytes) -> error code, unregister(address) -> error code)``:
    the CUDA runtime's cudaHostRegister (default flags) and cudaHostUnregister, through
    torch's bindings."""
    cudart = torch.cuda.cudart()
    return (
        lambda address, nbytes: int(cudart.cudaHostRegister(address, nbytes, 0)),
        lambda address: int(cudart.cudaHostUnregister(address)),
    )


def _clear_cuda_error() -> None:
    """Reset CUDA's last error after a failed call whose failure was handled here. torch's
    bindings have no cudaGetLastError; cuda-python's runtime does (nothing to do without it:
    the error then stays set, as it would have)."""
    runtime = _cuda_runtime()
    if runtime is not None:
        try:
            runtime.cudaGetLastError()
        except Exception:  # e.g. cuda-python built for another CUDA than the driver's
            pass


def private_cuda_stream(module, torch_device: torch.device, priority: int):
    """``(stream, None)``: a new non-blocking CUDA stream of ``priority`` on ``torch_device``
    that no one else uses, as a ``torch.cuda.ExternalStream``; or ``(None, reason)``."""
    if torch_device.type != "cuda":
        return None, f"private streams are made for CUDA devices only, not {torch_device.type!r}"
    if getattr(torch.version, "hip", None):
        return None, "cuda-python cannot create HIP streams (ROCm build of torch)"
    runtime = _cuda_runtime()
    if runtime is None:
        return None, "cuda-python is not installed (pip install cuda-bindings)"
    try:
        with module.device(torch_device):  # the stream belongs to the current device
            err, handle = runtime.cudaStreamCreateWithPriority(
                runtime.cudaStreamNonBlocking, priority
            )
    except Exception as error:  # e.g. cuda-python built for a newer CUDA than the driver's
        return None, f"cudaStreamCreateWithPriority raised {error!r}"
    if int(err) != 0:
        return None, f"cudaStreamCreateWithPriority failed with {err!r}"
    try:
        stream = module.ExternalStream(int(handle), device=torch_device)
    except Exception as error:
        runtime.cudaStreamDestroy(handle)  # nothing was queued on it yet
        return None, f"torch.cuda.ExternalStream refused the stream: {error!r}"
    weakref.finalize(stream, _destroy_stream, runtime, handle).atexit = False
    return stream, None


def _destroy_stream(runtime, handle) -> None:
    """Finalizer of a private stream's wrapper: never destroy it while work is queued."""
    runtime.cudaStreamSynchronize(handle)
    runtime.cudaStreamDestroy(handle)


def _warn_shared_pool(reason: str) -> None:
    global _shared_pool_warned
    if _shared_pool_warned:
        return
    _shared_pool_warned = True
    warnings.warn(
        f"megatron-offload: no private side streams ({reason}); using streams from torch's "
        "shared stream pool, which ProcessGroupNCCL also draws from, so a collective may queue "
        "behind an optimizer-state copy. Install cuda-python (pip install cuda-bindings) for "
        "streams of the offloader's own.",
        RuntimeWarning,
        stacklevel=3,
    )
