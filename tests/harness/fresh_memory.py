"""Regrown memory that holds garbage, as fresh device memory does."""

from __future__ import annotations


def poison_regrowth(offloader) -> None:
    """Fill every storage the offloader's devices regrow with 0xFF bytes (NaN for floats): on
    the CPU a regrown storage may find its old bytes again, so a wake or reload that forgot to
    write them would pass unseen."""
    for device in {id(e.device): e.device for e in offloader.engines}.values():
        regrow = device.regrow

        def poisoning(tensor, nbytes, regrow=regrow):
            regrow(tensor, nbytes)
            tensor.untyped_storage().fill_(0xFF)

        device.regrow = poisoning
