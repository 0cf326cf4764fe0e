"""Run a Megatron training script with ``--offload-optimizer-states`` available.

    python -m megatron_offload.launch SCRIPT.py [script arguments...]
    python -m megatron_offload.launch -m PACKAGE.MODULE [script arguments...]
    torchrun --nproc-per-node 8 -m megatron_offload.launch pretrain_gpt.py \\
        <Megatron flags> --use-distributed-optimizer --offload-optimizer-states

It calls ``megatron_offload.patch_megatron()`` and then runs the script as ``__main__``
with the remaining arguments, exactly as ``python SCRIPT.py ...`` would (the script's
directory first on ``sys.path``). The script must be built on ``megatron.training``
(``parse_and_validate_args`` and ``pretrain``); without the flag the run is unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = (
    "usage: python -m megatron_offload.launch SCRIPT.py [ARGS...]\n"
    "       python -m megatron_offload.launch -m MODULE [ARGS...]\n"
    "\n"
    "Runs a megatron.training script with --offload-optimizer-states (and the other flags of\n"
    "megatron_offload.add_arguments) added to its argument parser."
)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)

    from .megatron.training import patch_megatron

    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        module, rest = argv[1], argv[2:]
        patch_megatron()
        sys.argv = [module] + rest
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return

    script, rest = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"megatron_offload.launch: no such script: {script}", file=sys.stderr)
        raise SystemExit(2)
    patch_megatron()
    sys.argv = [script] + rest
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
