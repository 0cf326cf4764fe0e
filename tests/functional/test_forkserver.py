"""The fork server (``forkserver.py``) stands in for torchrun faithfully: a forked launch
records exactly what torchrun's launch of the same case records; one failing rank ends the
launch with its exit code and the others killed, and the server serves the next launch; a
launch over its time is killed with the server, and the next call starts another."""

from __future__ import annotations

import time

import pytest

from . import runner


def test_a_forked_launch_records_exactly_what_torchrun_records():
    forked = runner.run("dp2", offload=True)  # shared with test_pretrain_offload.py
    started = runner.run("dp2", offload=True, launcher="torchrun")
    assert (forked.launcher, started.launcher) == ("forkserver", "torchrun")
    # Per rank, every iteration's lm loss and grad norm (float.hex), skipped flag and the
    # offloader's figures, and every save's digest of the optimizer state.
    assert forked.ranks == started.ranks
    assert len(forked.ranks[0]["iterations"]) == runner.CASES["dp2"].train_iters
    assert [s["iteration"] for s in forked.ranks[0]["saves"]] == [3, 5]


def test_a_launch_the_server_cannot_serve_is_refused():
    with pytest.raises(ValueError, match="cannot run dp2 on cuda"):
        runner.run("dp2", offload=True, device="cuda", launcher="forkserver")
    with pytest.raises(ValueError, match="use 'torchrun' or 'forkserver'"):
        runner.run("dp2", offload=True, launcher="mpirun")


RANK_SCRIPT = """
import os, sys, time
rank, mode = int(os.environ["RANK"]), sys.argv[1]
with open(f"{mode}.pid{rank}", "w") as f:
    f.write(str(os.getpid()))
print("rank", rank, "of", os.environ["WORLD_SIZE"], "port", os.environ["MASTER_PORT"],
      "local", os.environ["LOCAL_RANK"], "argv", sys.argv[1:], "here", os.getcwd(),
      "marker", os.environ.get("MO_MARKER"), "main", __name__)
if mode == "fail" and rank == 1:
    while not os.path.exists("fail.pid0"):  # rank 0 is up and about to wait
        time.sleep(0.05)
    sys.exit(3)
if mode in ("fail", "hang"):
    time.sleep(600)  # as a rank waiting in a collective for one that died
"""


def _script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT)
    return path


def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):  # killed, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_each_rank_gets_torchruns_environment_and_a_failing_rank_ends_the_launch(tmp_path):
    env = {**runner.environment("cpu"), "MO_MARKER": "m"}
    log = runner.fork_launch(2, _script(tmp_path), ["ok"], env, str(tmp_path), "ok")
    server = runner.fork_server_pid()
    for rank in (0, 1):
        line = next(line for line in log.splitlines() if line.startswith(f"rank {rank} "))
        assert "of 2 port " in line and f"local {rank} argv ['ok'] here {tmp_path}" in line
        assert line.endswith("marker m main __main__")
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"exit codes \[-9, 3\]"):
        runner.fork_launch(2, _script(tmp_path), ["fail"], env, str(tmp_path), "fail")
    assert time.monotonic() - start < 60  # not the sleeping rank's 600 s
    assert _gone(int((tmp_path / "fail.pid0").read_text()))
    # The same server serves the next launch.
    assert "rank 1 of 2" in runner.fork_launch(
        2, _script(tmp_path), ["ok"], env, str(tmp_path), "ok"
    )
    assert runner.fork_server_pid() == server


def test_a_launch_over_its_time_is_killed_with_the_server(tmp_path):
    env = runner.environment("cpu")
    runner.fork_launch(1, _script(tmp_path), ["ok"], env, str(tmp_path), "ok")
    server = runner.fork_server_pid()
    with pytest.raises(AssertionError, match="did not answer within 3 s"):
        runner.fork_launch(2, _script(tmp_path), ["hang"], env, str(tmp_path), "hang", timeout=3)
    assert runner.fork_server_pid() is None
    assert _gone(server) and all(
        _gone(int((tmp_path / f"hang.pid{r}").read_text())) for r in (0, 1)
    )
    # The next call starts another server.
    assert "rank 0 of 1" in runner.fork_launch(
        1, _script(tmp_path), ["ok"], env, str(tmp_path), "ok"
    )
    assert runner.fork_server_pid() not in (None, server)
