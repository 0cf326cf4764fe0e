"""Host memory across the ranks of a node, agreed at attach before anything is allocated.

Every rank allocates (and on accelerators pins) a host arena of its own. Eight ranks on a node
pin eight, and an over-commit would end in the kernel's OOM killer or a pinning failure in
the middle of a run. So at attach every rank says what it needs and what its node can give
(``engine.host_limits``), the ranks gather that (one ``all_gather_object`` over the default
group, when torch.distributed is initialized: attach is then collective, as Megatron's
training loops call it on every rank), and each rank checks every node: if any node's ranks
need more together than it can give, or a rank would pin more than its ``ulimit -l``, every
rank refuses with the same figures, before anything is allocated.

``host_memory_budget="auto"`` takes each rank's budget from the same figures: its part of
what its node can give, in proportion to its need (a rank of a pipeline stage with more
parameters gets more).
"""

from __future__ import annotations

import socket
import warnings

from ..engine import host_limits
from ..errors import NodeMemoryError


def agree(
    need: int,
    *,
    pins: bool,
    budget: int | str | None,
    fallback: bool = False,
    spill: bool = False,
) -> tuple[int | None, bool]:
    """Refuse an over-commit on every rank; return this rank's budget (``"auto"``: its part
    of what its node can give; otherwise ``budget`` as given) and whether it pins its host
    memory: a rank that would pin more than its ``ulimit -l`` is refused, or with
    ``fallback`` uses pageable memory (one warning says what that costs). ``spill``: what a
    node cannot give goes to the disk tier, so a node whose ranks need more than it can give
    is not refused; each rank then holds (and pins) its part of what the node can give."""
    limits = host_limits.read()
    mine = (
        socket.gethostname(),
        int(need),
        limits.available,
        limits.memlock if pins else None,
        limits.describe(),
    )
    rows, rank = _gather(mine)
    nodes: dict[str, list] = {}
    for index, row in enumerate(rows):
        nodes.setdefault(row[0], []).append((index, *row[1:]))
    problems = []
    for host, members in nodes.items():
        total = sum(member[1] for member in members)
        available = min((member[2] for member in members if member[2] is not None), default=None)
        if spill and available is not None and total > available:
            # Each rank holds its part of what the node can give; the disk tier the rest.
            members = [(m[0], available * m[1] // total, *m[2:]) for m in members]
        elif available is not None and total > available:
            problems.append(
                f"node {host}: its {len(members)} rank(s) need {total:,} bytes of host memory "
                f"together (largest {max(m[1] for m in members):,}), but it can give {available:,} "
                f"({members[0][4]})"
            )
        for index, rank_need, _, memlock, _ in members:
            if memlock is not None and rank_need > memlock and not fallback:
                problems.append(
                    f"rank {index} on {host} would pin {rank_need:,} bytes, over its locked-memory "
                    f"limit of {memlock:,} (ulimit -l)"
                )
    if problems:
        raise NodeMemoryError(
            "offloading needs more host memory than there is: "
            + "; ".join(problems)
            + ". Nothing was allocated. Offload less (offload_fraction, per_optimizer, "
            "offload_master_weights=False), run fewer ranks per node, give the container more "
            "memory, or raise the locked-memory limit (ulimit -l unlimited)."
        )
    host = rows[rank][0]
    available = min((m[2] for m in nodes[host] if m[2] is not None), default=None)
    total = sum(m[1] for m in nodes[host])
    if spill and available is not None and total > available:
        need = available * need // total  # what this rank holds; the disk tier the rest
    memlock = limits.memlock if pins else None
    pin = memlock is None or need <= memlock
    if not pin:
        warnings.warn(
            f"megatron-offload: this rank would pin {need:,} bytes of host memory, over its "
            f"locked-memory limit of {memlock:,} (ulimit -l): its host memory is pageable, and "
            "every copy to or from it is synchronous with the host (offloading no longer "
            "overlaps computation). Raise the limit (ulimit -l unlimited, or the container's "
            "memlock limit) to pin it; require_pinned_memory=True refuses instead.",
            RuntimeWarning,
            stacklevel=4,
        )
    if budget != "auto":
        return budget, pin
    if available is None:
        return None, pin  # nothing limits this node
    if spill and total > available:
        return need, pin  # already this rank's part
    return (available if total == 0 else available * need // total), pin


def every_rank(ok: bool) -> bool:
    """True if ``ok`` on every rank: the ranks that agreed on host memory (``agree``) agree
    on whether each could allocate it, so that they go on, or raise, together."""
    rows, _ = _gather(bool(ok))
    return all(rows)


def _gather(row) -> tuple[list, int]:
    """Every rank's ``row`` in rank order, and this rank's index."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return [row], 0
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [row], 0
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows, dist.get_rank()
