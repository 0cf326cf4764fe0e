"""A fork server for the functional tests' CPU launches: ranks forked, torchrun's way, from one
process that imported torch and megatron once.

Each rank of a torchrun launch is a fresh interpreter: it imports torch (2.5 to 3 s of a core
here) and megatron.training with the model and dataset modules of the example (2.5 s more),
and torchrun's own agent imports torch too. Over a session of some twenty launches that is
about five minutes of CPU spent importing the same modules. This server imports them once and
forks the ranks of each launch from itself: every rank gets the environment torchrun gives
its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...),
its working directory, and the output file of the launch as its stdout and stderr, and then
runs the launch's script (``record_pretrain.py``) as ``__main__`` exactly as torchrun would run it: the forked rank
returns from the server's loop to the top of this script and leaves it the way the script
would end, so the interpreter's own exit (threads joined, ``atexit``, the exit code of a
``SystemExit``) is the one a torchrun worker gets. As torchrun does, when one rank fails the
others are killed.

Protocol (``runner.py`` speaks it): one JSON line per launch on stdin, ``{"world_size",
"script", "argv", "env", "cwd", "log"}``; one JSON line back per launch, ``{"returncodes": [...]}``, in
rank order; ``{"ready": true}`` once the imports are done. The server ends when stdin closes.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import sys
import uuid

from tests.harness.rank_pool import store_port


def _preload() -> None:
    """What every rank of a CPU launch imports before its first iteration (the recorder's
    imports, the CPU harness, megatron.training and the example script's model and dataset
    modules); nothing is initialized (no process group, no model, no thread)."""
    import torch  # noqa: F401

    from megatron_offload_testing import cpu_training

    # What record_pretrain.main() does first on a CPU rank (idempotent there).
    cpu_training.install()
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    import megatron.core.datasets.gpt_dataset  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.training.training  # noqa: F401

    import megatron_offload.launch  # noqa: F401
    import megatron_offload.megatron.training  # noqa: F401
    import megatron_offload_testing.records  # noqa: F401
    import tests.harness.gloo  # noqa: F401


def _torchrun_environment(rank: int, world_size: int, port: int, run_id: str) -> dict:
    """The variables torchrun (one node, ``--standalone``) sets in each worker's environment."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        # No agent here: rank 0 hosts the store (env:// rendezvous), as without torchrun.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def _become_rank(request: dict, rank: int, port: int, run_id: str) -> None:
    """In the forked child: the rank's output, input, directory, environment and argv."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    # As PYTHONUNBUFFERED in the launch's environment would have made them (read at start-up).
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.stderr.reconfigure(line_buffering=True, write_through=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(_torchrun_environment(rank, request["world_size"], port, run_id))
    sys.argv = [request["script"], *request["argv"]]


def _launch(request: dict) -> dict | list[int]:
    """Fork the launch's ranks and wait for them. Returns, in a forked rank, the request it
    runs; in the server, the ranks' exit codes (negative: killed by that signal)."""
    world_size = request["world_size"]
    # torchrun's agent listens for its workers' store itself; here rank 0 does, on a port no
    # other socket is handed meanwhile (store_port).
    port, run_id = store_port(), uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _become_rank(request, rank, port, run_id)
            return request
        pids.append(pid)
    codes: dict[int, int] = {}
    while len(codes) < world_size:
        pid, status = os.waitpid(-1, 0)
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0:
            # As torchrun does: one failed rank ends the launch (the others would wait for it
            # in their next collective until the timeout).
            for other in pids:
                if other not in codes:
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    return [codes[pid] for pid in pids]


def serve() -> dict | None:
    """The server's loop. Returns only in a forked rank (the request it runs), or None when
    stdin closes."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed in here goes to the server's stderr, not the replies
    _preload()
    # The preloaded objects never change: kept out of the collector's generations, a rank's
    # collections do not write to (and so copy) the pages it shares with the server.
    gc.freeze()
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        outcome = _launch(json.loads(line))
        if isinstance(outcome, dict):
            replies.close()
            return outcome
        replies.write(json.dumps({"returncodes": outcome}) + "\n")
    return None


if __name__ == "__main__":
    request = serve()
    if request is not None:
        # A forked rank: the script runs as torchrun runs it, and this script's end is the
        # rank's end.
        runpy.run_path(request["script"], run_name="__main__")
