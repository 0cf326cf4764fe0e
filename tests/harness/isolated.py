"""Run test bodies in a separate, long-lived Python process.

Touching a tensor whose storage was released crashes a CPU torch process outright
(segmentation fault). Test bodies that might do so (anything reading state after a
reload) run here: a crash becomes an ordinary test failure that names the exit code, and
the next call gets a fresh process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class IsolatedProcessDied(AssertionError):
    """The isolated process exited while running a job (for example a segfault: -11)."""

    def __init__(self, exitcode: int | None, what: str) -> None:
        self.exitcode = exitcode
        super().__init__(f"the isolated process running {what} died with exit code {exitcode}")


def _serve(conn) -> None:
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    while True:
        job = conn.recv()
        if job is None:
            return
        fn, args, kwargs = job
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class IsolatedProcess:
    """One worker process; ``run(fn, *args)`` calls a module-level ``fn`` inside it."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # results must not depend on the thread count
        try:
            self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            self._proc.start()
        finally:
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        child.close()
        self._conn = parent

    def run(self, fn, *args, **kwargs):
        if self._proc is None or not self._proc.is_alive():
            self._start()
        what = f"{fn.__module__}.{fn.__qualname__}"
        try:
            self._conn.send((fn, args, kwargs))
            if not self._conn.poll(self.timeout):
                self.close(kill=True)
                raise TimeoutError(f"{what} did not finish within {self.timeout} s")
            status, payload = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(5)
            code = self._proc.exitcode
            self._proc = None
            raise IsolatedProcessDied(code, what) from None
        if status == "error":
            raise AssertionError(f"{what} raised in the isolated process:\n{payload}")
        return payload

    def close(self, kill: bool = False) -> None:
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        else:
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._proc.join(10)
        self._proc = None
