"""One steady iteration of megatron-core's bf16 GPT on a gloo rank, profiled: within the files, functions and calls goals."""

from __future__ import annotations

from benchmarks import iteration_profile
from tests.harness.isolated import IsolatedProcess


def _both_modes():
    return {mode: iteration_profile.profile_job(mode == "chunked") for mode in ("whole", "chunked")}


def test_one_iteration_stays_within_the_files_functions_and_calls_goals():
    """One steady iteration of megatron-core's bf16 GPT on a gloo rank (the benchmark's own
    job, both modes in one process): whole mode at most 9 files and 30 functions of the
    package, chunked mode at most 12 files and 300 calls, with the states offloaded (the phase,
    the update gate and the guarded state mapping are a module each: docs/design.md)."""
    process = IsolatedProcess(timeout=300)  # its own: the job installs the CPU stand-ins
    try:
        out = process.run(_both_modes)
    finally:
        process.close()
    whole, chunked = out["whole"], out["chunked"]
    listing = {
        mode: [f"{path}:{line} {name} x{calls}" for path, line, name, calls in figures["table"]]
        for mode, figures in out.items()
    }
    assert whole["files"] <= 9 and whole["functions"] <= 30, listing["whole"]
    assert whole["calls"] <= 110, listing["whole"]
    assert chunked["files"] <= 12 and chunked["calls"] <= 300, listing["chunked"]
    # What was counted is the real cycle: the step wrapper, the engine's offload and reload,
    # the update's pre-hook, and something offloaded between the steps.
    for figures in (whole, chunked):
        names = {name for _, _, name, _ in figures["table"]}
        assert {
            "_step",
            "offload",
            "reload",
            "wait",
            "before_update",
            "finalize_model_grads",
        } <= names
        assert figures["offloaded"] > 0
