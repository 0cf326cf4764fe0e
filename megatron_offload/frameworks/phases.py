"""What a framework's "to the host" and "to the device" phases mean for an offloader.

``to_host``: copy every selected state to the host and free its device memory (what the
framework's own move did, asynchronous and in pieces, masters and their gradients included).
``to_device``: nothing, when ``attach`` runs the per-step cycle (the next step reloads the
states it needs, during the gradient reduction, so they stay off the device through the
forward and backward passes and any inference in between); otherwise bring them back and
order them before the current stream, as the framework expects after its move.
"""

from __future__ import annotations


def to_host(offloader) -> None:
    offloader.offload()


def to_device(offloader) -> None:
    if offloader.automatic:
        return
    offloader.reload()
    offloader.wait()
