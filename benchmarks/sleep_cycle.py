"""Bytes over the host link per sleep/wake cycle, against verl's way and a full copy.

    python -m benchmarks.sleep_cycle                          # 2 gloo ranks, bf16 GPT
    python -m benchmarks.sleep_cycle --world-size 4 --moe --frozen
    torchrun --nproc-per-node 8 -m benchmarks.sleep_cycle --gpu   # NOT EXERCISED here

Per rank and cycle (step, sleep, wake): the bytes ``sleep()`` and ``wake()`` copied through
the device interface (the host link on a GPU), what was rebuilt from the masters instead,
what was dropped (gradients); beside them what verl's moves carry for the same model (the
parameter buffers copied out and back, the gradients dropped, the optimizer states and
masters moved) and a full copy (parameters, gradients, states and masters, out and back).
On a GPU the cycle's time is compared with the link floor: the copied bytes at the pinned
bandwidth measured in the same run. On the CPU no time is reported (there is no link).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _model_bytes(chunks) -> dict:
    sizes = {"parameters": 0, "gradients": 0, "frozen": 0}
    for chunk in chunks:
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            sizes["parameters"] += buffer.param_data.untyped_storage().nbytes()
            sizes["gradients"] += buffer.grad_data.untyped_storage().nbytes()
        for param in chunk.parameters():
            if not param.requires_grad:
                sizes["frozen"] += param.untyped_storage().nbytes()
    return sizes


def _link_floor_s(nbytes: int, device) -> float | None:
    """Seconds ``nbytes`` take each way at the pinned bandwidth measured now (GPU only)."""
    if device.type != "cuda" or not nbytes:
        return None
    size = min(nbytes, 1 << 30)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    per_byte = (time.perf_counter() - start) / (2 * size)
    return nbytes * per_byte


def cycle_job(cfg: dict) -> dict:
    """On every rank: build, attach an offloader (no automatic cycle: the link bytes are
    sleep's and wake's alone), then ``cfg["cycles"]`` times step, sleep, wake."""
    import megatron_offload
    from tests.harness import models

    overrides = {}
    if cfg.get("moe"):
        overrides["transformer_overrides"] = dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="allgather",
            expert_model_parallel_size=cfg.get("ep", 2),
        )
    chunks, optimizer, config = models.build(
        "gpt",
        "bf16",
        num_layers=cfg["layers"],
        hidden=cfg["hidden"],
        freeze="position_embeddings" if cfg.get("frozen") else None,
        **overrides,
    )
    offloader = megatron_offload.OptimizerStateOffloader(optimizer)
    counted = {"out": 0, "back": 0}
    direction = ["out"]
    for device in {id(e.device): e.device for e in offloader.engines}.values():
        copy = device.copy

        def counting(dst, src, copy=copy):
            counted[direction[0]] += dst.numel() * dst.element_size()
            copy(dst, src)

        device.copy = counting
    model = _model_bytes(chunks)
    cycles = []
    for step in range(cfg["cycles"]):
        models.train_step(chunks, optimizer, config, step)
        counted.update(out=0, back=0)
        start = time.perf_counter()
        direction[0] = "out"
        offloader.sleep()
        direction[0] = "back"
        offloader.wake()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        stats = offloader.stats()
        states = 2 * stats["tracked_bytes"]  # the optimizer states and masters, out and back
        cycles.append(
            {
                "link_bytes": counted["out"] + counted["back"],
                "rebuilt_bytes": stats["rebuilt_parameter_bytes"],
                "copied_parameter_bytes": stats["copied_parameter_bytes"],
                "dropped_gradient_bytes": stats["dropped_gradient_bytes"],
                "verl_link_bytes": states + 2 * (model["parameters"] + model["frozen"]),
                "full_copy_link_bytes": states
                + 2 * (model["parameters"] + model["frozen"] + model["gradients"]),
                "seconds": seconds if torch.cuda.is_available() else None,
            }
        )
    device = next(chunks[0].parameters()).device
    last = cycles[-1]
    floor = _link_floor_s(last["link_bytes"] // 2, device)
    offloader.detach()
    return {"model": model, "cycles": cycles, "link_floor_s": floor}


def report(results: list[dict]) -> str:
    lines = []
    for rank, result in enumerate(results):
        last = result["cycles"][-1]
        lines.append(
            f"rank {rank}: per cycle {last['link_bytes']:,} bytes over the link "
            f"({last['rebuilt_bytes']:,} rebuilt, {last['copied_parameter_bytes']:,} "
            f"parameters copied, {last['dropped_gradient_bytes']:,} gradients dropped); "
            f"verl's way {last['verl_link_bytes']:,} "
            f"({last['verl_link_bytes'] / max(last['link_bytes'], 1):.2f}x), full copy "
            f"{last['full_copy_link_bytes']:,} "
            f"({last['full_copy_link_bytes'] / max(last['link_bytes'], 1):.2f}x)"
        )
        if result["link_floor_s"] is not None and last["seconds"] is not None:
            lines.append(
                f"rank {rank}: sleep+wake {last['seconds'] * 1e3:.1f} ms, link floor "
                f"{2 * result['link_floor_s'] * 1e3:.1f} ms"
            )
        else:
            lines.append(f"rank {rank}: no time reported (no accelerator link)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--frozen", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="run in this torchrun process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    cfg = dict(vars(args))
    if args.gpu:  # NOT EXERCISED: no GPU machine with megatron-core was available
        from .gpu import init_distributed, shutdown_distributed

        init_distributed(tp=1, pp=1)
        try:
            results = [cycle_job(cfg)]  # this rank's figures
        finally:
            shutdown_distributed()
    else:
        from tests.harness.rank_pool import RankPool

        with RankPool(world_size=args.world_size) as pool:
            results = pool.run(cycle_job, cfg, ep=2 if args.moe else 1)
    print(json.dumps(results, indent=1) if args.json else report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
