"""Interceptions on modules and classes (what the process installs: ``PROCESS``), and a
handle removed twice."""

from __future__ import annotations

import types

from megatron_offload.interceptions import Interceptions


def test_a_class_attribute_it_added_is_taken_away_and_one_it_replaced_put_back():
    class Base:
        def move(self):
            return "base"

    class Worker(Base):
        def own(self):
            return "own"

    installed = Interceptions()
    added = installed.replace(Worker, "move", lambda self: "delegated", why="test")
    replaced = installed.replace(Worker, "own", lambda self: "delegated", why="test")
    assert Worker().move() == Worker().own() == "delegated"
    assert [where for _, where, _ in installed.listing()] == [
        f"{Worker.__qualname__}.move",
        f"{Worker.__qualname__}.own",
    ]
    added.remove()
    added.remove()  # again: nothing
    assert "move" not in vars(Worker) and Worker().move() == "base"
    replaced.remove()
    assert Worker().own() == "own" and installed.listing() == []


def test_a_module_function_is_replaced_and_put_back_unless_replaced_since():
    module = types.ModuleType("some_framework")
    module.train = own = lambda: "own"
    installed = Interceptions()
    handle = installed.replace(module, "train", lambda: "ours", why="test", only_if_ours=True)
    assert module.train() == "ours" and installed.listing()[0][1] == "some_framework.train"
    module.train = theirs = lambda: "theirs"  # someone else's, after ours
    handle.remove()
    assert module.train is theirs and module.train is not own
