"""What a framework's "to the host" and "to the device" phases mean for an offloader.

``to_host``: copy every selected state to the host and free its device memory (what the
framework's own move did, asynchronous and in pieces, masters and their gradients included).
``to_device``: nothing, when ``attach`` runs the per-step cycle (the next step reloads the
states it needs, during the gradient reduction, so they stay off the device through the
forward and backward passes and any inference in between); otherwise bring them back and
order them before the current stream, as the framework expects after its move.
``model_to_host`` / ``model_to_device``: the framework's model moves become ``sleep()`` /
``wake()`` of the parts it moves (parameters, gradients): the parameters are made again from
the masters where they can be, instead of copied out and back; the gradients are dropped and
zeroed, as the frameworks' own moves do.
"""

from __future__ import annotations


def to_host(offloader, *args, **kwargs) -> None:
    offloader.offload()


def to_device(offloader, *args, **kwargs) -> None:
    if offloader.automatic:
        return
    offloader.reload()
    offloader.wait()


def model_to_host(offloader, model, *, parameters: bool = True, gradients: bool = True) -> None:
    offloader.sleep(model, parameters=parameters, gradients=gradients)


def model_to_device(offloader, *, parameters: bool = True, gradients: bool = True) -> None:
    offloader.wake(parameters=parameters, gradients=gradients)
