"""Device work of one steady training step: the operations dispatched and the host
synchronizations, plain against attached, for every mode of the offloader.

    python -m benchmarks.launch_budget            # 2 gloo ranks, bf16 GPT, 2 and 4 layers

A ``TorchDispatchMode`` counts every aten operation dispatched from ``zero_grad`` to the end of
``optimizer.step()`` (forward, backward, the gradient reduction, the step, and the offloader's
own reload, wait and offload). On a GPU each of those operations is a kernel launch, a copy or
an allocator call: counted on a CPU, they are the launches a GPU would pay (why:
docs/memory-on-gpu.md, "Launches per step"). Host synchronizations are counted where the host
waits for the device: an operation that reads a tensor's value on the host
(``aten::_local_scalar_dense``: ``item()``, ``bool()``) and the offloader's device calls that
block (``synchronize``, ``synchronize_event``).

Modes: the whole-state cycle with each prefetch point, the chunked update, the cycle after a
``sleep()``/``wake()``, and the cycle with a checkpoint (``state_dict()``) served from the host
between steps. Each is measured on the same model with 2 and 4 layers: the offloader's addition
(attached minus plain) must not grow with the number of tensors (it may grow with pieces,
chunks or buffers).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

#: Operations that only make a new view of memory or mark a profiler range: dispatched, but no
#: kernel, copy or allocation on a GPU (re-pointing a tensor into a slot is one of them).
METADATA = frozenset(
    {
        "as_strided",
        "set_",
        "view",
        "_unsafe_view",
        "_reshape_alias",
        "alias",
        "detach",
        "slice",
        "select",
        "t",
        "transpose",
        "unsqueeze",
        "squeeze",
        "expand",
        "permute",
        "_record_function_enter_new",
        "_record_function_exit",
    }
)
MODES = ("prefetch=gradients", "prefetch=step", "prefetch=0.5", "chunked", "slept", "checkpoint")
# A per-piece bound on the offloader's addition, and on how it may grow between two models
# with more tensors: operations per piece or chunk (a reload's regrow and copy, an offload's
# copy and release, the waits), with room for a constant.
PER_PIECE = 12
CONSTANT = 24


def _counting_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.host_reads = 0
            self.names = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.names[func.__name__.split(".")[0]] += 1
            if func.__name__.startswith("_local_scalar_dense"):
                self.host_reads += 1
            return func(*args, **(kwargs or {}))

    return Counting()


def _count_blocking(devices, counter: dict):
    """Count the devices' blocking calls (a host synchronization on a GPU)."""
    for device in devices:
        for name in ("synchronize", "synchronize_event"):
            original = getattr(device, name)

            def blocking(*args, original=original, **kwargs):
                counter["blocking"] += 1
                return original(*args, **kwargs)

            setattr(device, name, blocking)


def step_job(cfg: dict) -> dict:
    """On every rank: build the bf16 GPT with ``cfg["layers"]``, attach as ``cfg["mode"]``
    asks (None: plain), train to the steady state, then count one step."""

    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build(
        "gpt", "bf16", num_layers=cfg["layers"], overlap_grad_reduce=True, bucket_size=3000
    )
    mode = cfg["mode"]
    offloader = None
    if mode is not None:
        options = {}
        if mode.startswith("prefetch="):
            value = mode.split("=", 1)[1]
            options["prefetch"] = float(value) if value[0].isdigit() else value
        elif mode == "chunked":
            options["chunked_update_bytes"] = 1 << 18
        offloader = megatron_offload.attach(optimizer, **options)
        for hook in cfg.get("plant", ()):
            offloader.register_offload_pre_hook(_PLANTS[hook])
    steps = 3
    for step in range(steps):
        models.train_step(chunks, optimizer, config, step)
        if mode == "slept":  # after every step: any number of sleeps costs the steps nothing
            offloader.sleep()
            offloader.wake()
    if mode == "checkpoint":
        optimizer.state_dict()  # served from the host copy between steps
    counter = {"blocking": 0}
    if offloader is not None:
        _count_blocking({id(e.device): e.device for e in offloader.engines}.values(), counter)
    counting = _counting_mode()
    with counting:
        models.train_step(chunks, optimizer, config, steps)
    tensors = sum(
        1
        for wrapper in models.megatron_optimizers(optimizer)
        for group in wrapper.optimizer.param_groups
        for _ in group["params"]
    )
    found = {
        "mode": mode or "plain",
        "layers": cfg["layers"],
        "ops": counting.ops,
        "launches": sum(n for name, n in counting.names.items() if name not in METADATA),
        "host_reads": counting.host_reads,
        "blocking": counter["blocking"],
        "parameters": tensors,
        "names": dict(counting.names),
    }
    if offloader is not None:
        stats = offloader.stats()
        found["pieces"] = sum(stats["pieces"].values())
        found["chunks"] = stats.get("update_chunks", 0)
        offloader.detach()
    return found


def _per_tensor(offloader) -> None:
    """A planted per-tensor operation at every offload (the negative control)."""
    import torch

    for member in offloader.members:
        for group in member.optimizer.optimizer.param_groups:
            for param in group["params"]:
                torch.zeros(1).add_(1)


_PLANTS = {"per-tensor": _per_tensor}


def measure(pool, modes=MODES, layers=(2, 4), plant=()) -> list[dict]:
    """Rows of rank 0's figures: every mode and layer count, with the plain step beside."""
    rows = []
    for count in layers:
        plain = pool.run(step_job, {"mode": None, "layers": count})[0]
        for mode in modes:
            found = pool.run(step_job, {"mode": mode, "layers": count, "plant": plant})[0]
            found["added_ops"] = found["ops"] - plain["ops"]
            found["added_launches"] = found["launches"] - plain["launches"]
            found["added_host_reads"] = found["host_reads"] - plain["host_reads"]
            found["plain_ops"] = plain["ops"]
            found["plain_launches"] = plain["launches"]
            rows.append(found)
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "One steady step (rank 0): operations dispatched (all; launches: without views and "
        "profiler marks), plain and attached",
        f"{'mode':<20}{'layers':>7}{'params':>8}{'plain ops':>11}{'added ops':>11}"
        f"{'plain launches':>16}{'added launches':>16}{'pieces':>8}{'chunks':>8}"
        f"{'host reads +':>14}{'blocking':>10}",
    ]
    for row in rows:
        lines.append(
            f"{row['mode']:<20}{row['layers']:>7}{row['parameters']:>8}{row['plain_ops']:>11}"
            f"{row['added_ops']:>11}{row['plain_launches']:>16}{row['added_launches']:>16}"
            f"{row.get('pieces', 0):>8}{row.get('chunks', 0):>8}"
            f"{row['added_host_reads']:>14}{row['blocking']:>10}"
        )
    return "\n".join(lines)


def over_budget(rows: list[dict]) -> list[str]:
    """What breaks the budget: a mode whose added launches exceed ``PER_PIECE`` per piece and
    chunk plus ``CONSTANT``, or grow between the layer counts by more than ``PER_PIECE`` per
    piece and chunk added (they must not follow the tensors), or that reads a tensor on the
    host or blocks on the device during the step."""
    problems = []
    by_mode: dict = {}
    for row in rows:
        units = row.get("pieces", 0) + row.get("chunks", 0)
        if row["added_launches"] > PER_PIECE * units + CONSTANT:
            problems.append(
                f"{row['mode']} ({row['layers']} layers): {row['added_launches']} added"
            )
        if row["added_host_reads"] or row["blocking"]:
            problems.append(f"{row['mode']} ({row['layers']} layers): a host synchronization")
        by_mode.setdefault(row["mode"], []).append((units, row))
    for mode, found in by_mode.items():
        found.sort(key=lambda pair: pair[1]["layers"])
        for (units_a, a), (units_b, b) in zip(found, found[1:]):
            grown = b["added_launches"] - a["added_launches"]
            if grown > PER_PIECE * max(0, units_b - units_a):
                problems.append(
                    f"{mode}: {grown} more launches for {b['parameters'] - a['parameters']} more "
                    f"parameters and {units_b - units_a} more pieces and chunks"
                )
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    from tests.harness.rank_pool import RankPool

    with RankPool(world_size=2) as pool:
        rows = measure(pool)
    for row in rows:
        row.pop("names", None)
    print(json.dumps(rows, indent=1) if args.json else report(rows))
    problems = over_budget(rows)
    for problem in problems:
        print("over budget:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
