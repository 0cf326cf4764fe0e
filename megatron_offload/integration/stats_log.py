"""The offload figures of a training run: one log line per log interval (the maximum over
ranks) and the same figures as TensorBoard / W&B scalars. ``integration.training`` calls it
from megatron.training's ``training_log``; custom loops may call ``log_offload_stats``."""

from __future__ import annotations

GIB = float(1 << 30)
SCALAR_NAMES = {
    'offloaded_gib': 'optimizer-offload/offloaded-GiB',
    'host_gib': 'optimizer-offload/host-GiB',
    'd2h_ms': 'optimizer-offload/d2h-ms',
    'd2h_gbps': 'optimizer-offload/d2h-GBps',
    'h2d_ms': 'optimizer-offload/h2d-ms',
    'h2d_gbps': 'optimizer-offload/h2d-GBps',
    'exposed_ms': 'optimizer-offload/exposed-ms',
    'issue_ms': 'optimizer-offload/issue-ms',
    'checkpoint_wait_ms': 'optimizer-offload/checkpoint-wait-ms',
}
#: Figures reduced with the minimum over ranks (the slowest link), not the maximum.
MIN_OVER_RANKS = ('d2h_gbps', 'h2d_gbps')


def offload_figures(stats: dict) -> dict:
    """The logged figures from ``OptimizerStateOffloader.stats()``: transfer milliseconds and
    GB/s measured on the device, the milliseconds the compute stream waited for a copy
    (exposed), the host milliseconds spent issuing the offload and reload (issue), and those
    checkpoints and reads served from the host copy waited for copies out to complete, since
    attach (checkpoint wait)."""
    return {
        'offloaded_gib': stats['offloaded_bytes'] / GIB,
        'host_gib': stats['host_bytes'] / GIB,
        'd2h_ms': stats['d2h_ms'],
        'd2h_gbps': stats['d2h_gbps'],
        'h2d_ms': stats['h2d_ms'],
        'h2d_gbps': stats['h2d_gbps'],
        'exposed_ms': stats['exposed_ms'],
        'issue_ms': (stats['offload_seconds'] + stats['reload_seconds']) * 1e3,
        'checkpoint_wait_ms': stats.get('host_view_wait_ms', 0.0),
    }


def format_offload_stats(iteration: int, figures: dict, *, ranks: int = 1) -> str:
    """The log line (one per log interval)."""
    scope = f' (max over {ranks} ranks; GB/s: min)' if ranks > 1 else ''
    return (
        f' [optimizer-state offload] iteration {iteration:8d} |'
        f' offloaded: {figures["offloaded_gib"]:.6f} GiB |'
        f' host: {figures["host_gib"]:.6f} GiB |'
        f' D2H: {figures["d2h_ms"]:.3f} ms ({figures["d2h_gbps"]:.2f} GB/s) |'
        f' H2D: {figures["h2d_ms"]:.3f} ms ({figures["h2d_gbps"]:.2f} GB/s) |'
        f' exposed: {figures["exposed_ms"]:.3f} ms |'
        f' issue: {figures["issue_ms"]:.3f} ms |'
        f' checkpoint wait: {figures["checkpoint_wait_ms"]:.3f} ms |{scope}'
    )


def _max_over_ranks(values: list) -> tuple[list, int]:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values, 1
    from ..device import collective_device

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
