"""The offload figures: ``stats()`` summed over optimizers, the one-line ``summary()``, and
for a training run one log line per log interval (the maximum over ranks) with the same
figures as TensorBoard / W&B scalars. ``megatron.training`` calls it from megatron.training's
``training_log``; custom loops may call ``log_offload_stats``."""

from __future__ import annotations

from .device import numa
from .engine.figures import gbps

GIB = float(1 << 30)
SCALAR_NAMES = {
    "offloaded_gib": "optimizer-offload/offloaded-GiB",
    "host_gib": "optimizer-offload/host-GiB",
    "d2h_ms": "optimizer-offload/d2h-ms",
    "d2h_gbps": "optimizer-offload/d2h-GBps",
    "h2d_ms": "optimizer-offload/h2d-ms",
    "h2d_gbps": "optimizer-offload/h2d-GBps",
    "exposed_ms": "optimizer-offload/exposed-ms",
    "issue_ms": "optimizer-offload/issue-ms",
    "checkpoint_wait_ms": "optimizer-offload/checkpoint-wait-ms",
}
#: Figures reduced with the minimum over ranks (the slowest link), not the maximum.
MIN_OVER_RANKS = ("d2h_gbps", "h2d_gbps")


def combine(
    per: list[dict], *, cycles: int, devices: list, host_views: dict, sleep: dict | None = None
) -> dict:
    """The engines' ``stats()`` (``per``) summed: counts per kind merged, the largest piece
    the largest, rates of the summed bytes and times (not a sum of rates); with the cycles,
    the pinned bytes and NUMA figures of ``devices`` and what host views served."""
    total: dict = {}
    for key in per[0] if per else {}:
        if isinstance(per[0][key], dict):  # counts per kind (``pieces``)
            merged: dict = {}
            for figures in per:
                for kind, count in figures[key].items():
                    merged[kind] = merged.get(kind, 0) + count
            total[key] = merged
        elif key == "largest_piece_bytes":
            total[key] = max(s[key] for s in per)
        else:
            total[key] = sum(s[key] for s in per)
    for direction in ("d2h", "h2d"):
        total[f"{direction}_gbps"] = gbps(
            total.get(f"{direction}_timed_bytes", 0), total.get(f"{direction}_ms", 0.0)
        )
    total["cycles"] = cycles
    # What of host_bytes is pinned (the rest fell back to pageable memory, or the device pins
    # nothing: a CPU).
    unique = {id(device): device for device in devices}.values()
    total["pinned_host_bytes"] = sum(device.pinned_bytes() for device in unique)
    total.update(numa.figures(devices))
    total.update(host_views)
    if sleep is not None:  # what the last sleep did with the model's own tensors
        total.update(sleep)
        total["host_bytes"] = total.get("host_bytes", 0) + sleep["sleep_host_bytes"]
        total["disk_bytes"] = total.get("disk_bytes", 0) + sleep["sleep_disk_bytes"]
    total["per_optimizer"] = per
    return total


def offload_figures(stats: dict) -> dict:
    """The logged figures from ``OptimizerStateOffloader.stats()``: transfer milliseconds and
    GB/s measured on the device, the milliseconds the compute stream waited for a copy
    (exposed), the host milliseconds spent issuing the offload and reload (issue), and those
    checkpoints and reads served from the host copy waited for copies out to complete, since
    attach (checkpoint wait)."""
    return {
        "offloaded_gib": stats["offloaded_bytes"] / GIB,
        "host_gib": stats["host_bytes"] / GIB,
        "d2h_ms": stats["d2h_ms"],
        "d2h_gbps": stats["d2h_gbps"],
        "h2d_ms": stats["h2d_ms"],
        "h2d_gbps": stats["h2d_gbps"],
        "exposed_ms": stats["exposed_ms"],
        "issue_ms": (stats["offload_seconds"] + stats["reload_seconds"]) * 1e3,
        "checkpoint_wait_ms": stats.get("host_view_wait_ms", 0.0),
    }


#: The units ``human_bytes`` writes (a parser of the log line reads them back).
UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(nbytes: float) -> str:
    """``nbytes`` in the binary unit that keeps it under 1024, with 4 significant digits
    (``617.0 KiB``, ``1.500 GiB``; whole bytes below 1 KiB)."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} B"
    decimals = 3 if abs(value) < 10 else 2 if abs(value) < 100 else 1
    return f"{value:.{decimals}f} {UNITS[unit]}"


def _copy(name: str, ms: float, gbps: float) -> str:
    """A copy's figure, or nothing while none was measured."""
    return f" {name}: {ms:.3f} ms ({gbps:.2f} GB/s) |" if ms > 0 else ""


def format_offload_stats(iteration: int, figures: dict, *, ranks: int = 1) -> str:
    """The log line (one per log interval): sizes in human units; copy times and the
    checkpoint wait only once measured."""
    scope = f" (max over {ranks} ranks; GB/s: min)" if ranks > 1 else ""
    wait = figures["checkpoint_wait_ms"]
    return (
        f" [optimizer-state offload] iteration {iteration:8d} |"
        f" offloaded: {human_bytes(figures['offloaded_gib'] * GIB)} |"
        f" host: {human_bytes(figures['host_gib'] * GIB)} |"
        + _copy("D2H", figures["d2h_ms"], figures["d2h_gbps"])
        + _copy("H2D", figures["h2d_ms"], figures["h2d_gbps"])
        + f" exposed: {figures['exposed_ms']:.3f} ms |"
        f" issue: {figures['issue_ms']:.3f} ms |"
        + (f" checkpoint wait: {wait:.3f} ms |" if wait > 0 else "")
        + scope
    )


def summary(stats: dict) -> str:
    """One line for people from ``OptimizerStateOffloader.stats()``: what is offloaded and
    held on the host, the last copies out and back with their rates (once measured), the
    time the compute stream waited for a copy-back, and the cycles."""
    parts = [
        f"offloaded {human_bytes(stats['offloaded_bytes'])}",
        f"host {human_bytes(stats['host_bytes'])}",
    ]
    for name, key in (("D2H", "d2h"), ("H2D", "h2d")):
        if stats[f"{key}_ms"] > 0:
            parts.append(
                f"last {name} {stats[f'{key}_ms']:.3f} ms ({stats[f'{key}_gbps']:.2f} GB/s)"
            )
    parts.append(f"exposed {stats['exposed_ms']:.3f} ms")
    parts.append(f"{stats['cycles']} cycle{'s' if stats['cycles'] != 1 else ''}")
    return " | ".join(parts)


def _max_over_ranks(values: list) -> tuple[list, int]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values, 1
    from .device import collective_device

    device = collective_device(dist.get_backend())  # NCCL reduces device tensors only
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist(), dist.get_world_size()


def log_offload_stats(iteration: int, offloader, *, writer=None, wandb_writer=None, printer=None):
    """Print the figures of ``offloader`` (max over ranks) and write them as scalars.

    Collective when torch.distributed is initialized: every rank must call it at the same
    iterations (megatron.training calls ``training_log`` on every rank).
    """
    figures = offload_figures(offloader.stats())
    keys = list(figures)
    # One MAX all-reduce for every figure: the minimum of a rate is minus the maximum of
    # its negation.
    signs = [-1.0 if k in MIN_OVER_RANKS else 1.0 for k in keys]
    values, ranks = _max_over_ranks([sign * figures[k] for sign, k in zip(signs, keys)])
    figures = {k: sign * v for sign, k, v in zip(signs, keys, values)}
    (printer or _print_rank_last)(format_offload_stats(iteration, figures, ranks=ranks))
    if writer is not None:
        for key, value in figures.items():
            writer.add_scalar(SCALAR_NAMES[key], value, iteration)
    if wandb_writer is not None:
        wandb_writer.log({SCALAR_NAMES[key]: value for key, value in figures.items()}, iteration)
    return figures


def _print_rank_last(message: str) -> None:
    try:
        from megatron.training.utils import print_rank_last
    except ImportError:
        print(message, flush=True)
        return
    print_rank_last(message)
