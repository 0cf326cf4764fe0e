"""What the offloader reads of the CUDA caching allocator's configuration.

PyTorch configures its allocator from ``PYTORCH_CUDA_ALLOC_CONF`` (``PYTORCH_ALLOC_CONF`` in
newer releases), a comma-separated list of ``key:value`` options read once, at the first
CUDA allocation. Two of them change what our released pieces are worth to the rest of the
process:

* ``max_split_size_mb``: a cached block of that size or more is never split, and a request
  below it never takes such a block. A freed piece larger than the bound can then serve
  nothing but another request of about its own size; the activations of the next forward
  pass allocate new memory beside it. So pieces are kept below the bound
  (``splittable_piece_bytes``): a piece of at most that size is carved from a segment under
  the bound (large segments are rounded up to 2 MiB), which stays splittable once freed.
* ``backend:cudaMallocAsync``: a block freed after ``record_stream`` is given back with
  ``cudaFreeAsync`` on its allocation stream, after that stream was made to wait for every
  recorded stream. Our release therefore makes the compute stream wait for the copy out;
  nothing the offloader can do keeps that memory usable earlier, so it says so, once, with
  the measured time (``offloader/allocator_warnings.py``).

Pure Python: nothing here touches a device.
"""

from __future__ import annotations

import os
from typing import Mapping

MiB = 1 << 20
SEGMENT_ROUND = 2 * MiB  # large segments are the request rounded up to this (CUDACachingAllocator)
CONFIG_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allocator options in effect: ``{key: value}`` from the first of
    ``PYTORCH_CUDA_ALLOC_CONF`` and ``PYTORCH_ALLOC_CONF`` that is set (keys lower-case)."""
    environ = os.environ if environ is None else environ
    for name in CONFIG_VARIABLES:
        text = environ.get(name)
        if text:
            break
    else:
        return {}
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition(":")
        if sep and key.strip():
            out[key.strip().lower()] = value.strip()
    return out


def backend(environ: Mapping[str, str] | None = None) -> str:
    """``"native"`` (the caching allocator) or ``"cudaMallocAsync"``."""
    return settings(environ).get("backend", "native")


def max_split_size(environ: Mapping[str, str] | None = None) -> int | None:
    """``max_split_size_mb`` in bytes, or None when it is not set (no bound)."""
    value = settings(environ).get("max_split_size_mb")
    if value is None:
        return None
    try:
        mb = int(value)
    except ValueError:
        return None  # torch refuses it at its first allocation, with its own message
    return mb * MiB if mb > 0 else None


def splittable_piece_bytes(max_split: int) -> int:
    """The largest piece whose segment stays under ``max_split`` (whole 2 MiB units)."""
    return max(SEGMENT_ROUND, (max_split - 1) // SEGMENT_ROUND * SEGMENT_ROUND)


def piece_bound(environ: Mapping[str, str] | None = None) -> int | None:
    """The largest piece the native allocator can split again once it is freed, or None
    (no ``max_split_size_mb``, or the ``cudaMallocAsync`` backend, which has no such bound)."""
    if backend(environ) != "native":
        return None
    bound = max_split_size(environ)
    return None if bound is None else splittable_piece_bytes(bound)
