"""The command-line switch of optimizer-state offloading, and the error a bad command line gets.

Shared by ``arguments`` (our flags and their validation) and ``coexistence`` (a Megatron with
an offloader of its own), which both need them and neither imports the other's users.
"""

from __future__ import annotations

OFFLOAD_FLAG = "--offload-optimizer-states"
CHUNKED_FLAG = "--offload-chunked-update-bytes"


from ..errors import OffloadArgumentError  # noqa: E402,F401 - raised here; every exception lives in errors.py


def offload_enabled(args) -> bool:
    """True when ``args`` asks for optimizer-state offloading."""
    return bool(getattr(args, "offload_optimizer_states", False))
