"""The chunked update: the optimizer step with its states kept on the host, streamed through
device slots."""

from .update import ChunkedUpdate

__all__ = ["ChunkedUpdate"]
