"""Every exception of the package lives in ``errors.py`` under ``OffloadError``; a refusal
every rank raises is printed once, by rank 0, without a traceback."""

import ast
import pathlib
import sys

import pytest

import megatron_offload
from megatron_offload import errors

PACKAGE = pathlib.Path(megatron_offload.__file__).parent


def test_exception_classes_are_defined_in_errors_only():
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                getattr(base, "id", getattr(base, "attr", "")).endswith(("Error", "Exception"))
                for base in node.bases
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert found and all(place.startswith("errors.py:") for place in found), found


@pytest.mark.parametrize(
    "name",
    [
        "OffloadArgumentError",
        "HostMemoryBudgetError",
        "NodeMemoryError",
        "OffloadStateError",
        "SlotSizeError",
        "PinError",
    ],
)
def test_each_exception_is_an_offload_error_and_exported(name):
    cls = getattr(megatron_offload, name)
    assert (
        issubclass(cls, megatron_offload.OffloadError)
        and cls.__module__ == "megatron_offload.errors"
    )


def _hook_output(capsys, monkeypatch, error, rank):
    monkeypatch.setenv("RANK", str(rank))
    seen = []
    errors._excepthook(type(error), error, None, previous=lambda *a: seen.append(a))
    return capsys.readouterr().err, seen


def test_a_refusal_is_printed_once_by_rank_0_as_its_message(capsys, monkeypatch):
    refusal = megatron_offload.OffloadArgumentError("use one of them")
    assert _hook_output(capsys, monkeypatch, refusal, 0) == (
        "megatron-offload: OffloadArgumentError: use one of them\n",
        [],
    )
    assert _hook_output(capsys, monkeypatch, refusal, 3) == ("", [])
    # Per-rank errors name their rank; anything else goes to the previous hook, untouched.
    budget = megatron_offload.HostMemoryBudgetError("raise host_memory_budget")
    assert _hook_output(capsys, monkeypatch, budget, 3)[0] == (
        "megatron-offload (rank 3): HostMemoryBudgetError: raise host_memory_budget\n"
    )
    other = KeyError("x")
    assert _hook_output(capsys, monkeypatch, other, 0) == ("", [(KeyError, other, None)])


def test_the_hook_is_installed_once_and_restored(monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    from megatron_offload.interceptions import PROCESS

    errors.print_refusals_once()
    installed = sys.excepthook
    errors.print_refusals_once()
    assert sys.excepthook is installed and installed is not sys.__excepthook__
    # A process-wide change, listed where every other one is.
    assert [where for _, where, _ in PROCESS.listing()].count("sys.excepthook") == 1
    errors.restore_excepthook()
    assert sys.excepthook is sys.__excepthook__
    assert "sys.excepthook" not in [where for _, where, _ in PROCESS.listing()]


def test_the_installed_hook_prints_a_refusal_and_passes_anything_else_on(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a))
    monkeypatch.setenv("RANK", "0")
    errors.print_refusals_once()
    try:
        refusal = megatron_offload.OffloadArgumentError("use one of them")
        sys.excepthook(type(refusal), refusal, None)
        other = ValueError("x")
        sys.excepthook(ValueError, other, None)
    finally:
        errors.restore_excepthook()
    assert capsys.readouterr().err == "megatron-offload: OffloadArgumentError: use one of them\n"
    assert seen == [(ValueError, other, None)]


def test_the_rank_comes_from_the_process_group_and_a_broken_one_falls_back_to_rank(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    assert errors._rank() == 5

    def broken():
        raise RuntimeError("the process group was destroyed")

    monkeypatch.setattr(dist, "get_rank", broken)
    assert errors._rank() == 2
