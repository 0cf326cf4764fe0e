"""Everything an offloader changes in the objects it serves, installed one way, listed on request.

An offloader changes megatron-core's and torch's objects in two ways only, both through
``Interceptions``:

* ``replace`` / ``wrap``: an attribute of one object is replaced (a method wrapped on the
  instance, the ``_state_offloader`` mark, a model config's ``finalize_model_grads_func``; a
  function of a module, a method of a class); removing it puts back what the object had (its
  own attribute, or none: the class's again). ``only_if_ours``: it is put back only if it is
  still what was installed (someone may have replaced it since, and theirs stays).
* ``hook``: a torch hook registered by the caller (a step pre-hook, the state-dict hooks, a
  forward pre-hook, a gradient accumulator's hook), whose handle is kept here.

Each returns an ``Interception``: a removable handle, as torch's hooks return, which also says
what it changed, where, and why. The component that installed one removes it when its job is
done (sleep's hooks at wake); ``remove_all`` (``detach``) removes whatever is left, newest
first; ``listing()`` (``offloader.interceptions.listing()``) is what is installed now.

What is installed for the whole process rather than for one offloader (``patch_megatron``'s
wraps of ``megatron.training``, the frameworks' ``install``) is in ``PROCESS``, and
``PROCESS.listing()`` says what it is; ``unpatch_megatron`` and the frameworks' ``uninstall``
remove theirs.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any, Callable

_MISSING = object()


@dataclass(eq=False)
class Interception:
    """One change: ``kind`` ("attribute" or "hook"), ``where`` (the object's class and the
    attribute, or the hook), ``why`` (for a person)."""

    kind: str
    where: str
    why: str
    _undo: Callable[[], None] = field(repr=False, default=lambda: None)
    _registry: Any = field(repr=False, default=None)

    def remove(self) -> None:
        """Undo the change (again: nothing)."""
        registry, self._registry = self._registry, None
        if registry is None:
            return
        registry.forget(self)
        self._undo()


class Interceptions:
    """The changes one offloader made, in the order they were made."""

    def __init__(self) -> None:
        self._installed: list[Interception] = []

    def replace(
        self, obj, name: str, value, *, why: str, only_if_ours: bool = False
    ) -> Interception:
        """Set ``obj.name = value`` on the object itself (an instance, a module, a class) until
        the handle is removed."""
        previous = vars(obj).get(name, _MISSING)
        _set(obj, name, value)

        def undo() -> None:
            if only_if_ours and vars(obj).get(name, _MISSING) is not value:
                return  # replaced since by someone else: theirs stays
            _set(obj, name, previous)

        return self.record("attribute", f"{_name_of(obj)}.{name}", why, undo)

    def wrap(self, obj, name: str, make: Callable[[Callable], Callable], *, why: str):
        """Replace the method ``obj.name`` on the instance by ``make(the method now)``."""
        previous = getattr(obj, name)
        return self.replace(obj, name, functools.update_wrapper(make(previous), previous), why=why)

    def hook(self, handle, *, where: str, why: str, keep: Any = None) -> Interception:
        """Keep a torch hook's ``handle`` (``keep``: an object the hook lives on, held until
        it is removed)."""
        kept = [keep]

        def undo() -> None:
            handle.remove()
            kept.clear()

        return self.record("hook", where, why, undo)

    def listing(self) -> list[tuple[str, str, str]]:
        """``(kind, where, why)`` of every change installed now, in the order made."""
        return [(i.kind, i.where, i.why) for i in self._installed]

    def remove_all(self) -> None:
        for interception in reversed(list(self._installed)):
            interception.remove()

    def forget(self, interception: Interception) -> None:
        self._installed = [i for i in self._installed if i is not interception]

    def record(self, kind: str, where: str, why: str, undo: Callable[[], None]) -> Interception:
        """A change the caller made itself (an attribute whose undo needs more than putting
        the old value back: a state mapping refilled), undone by ``undo``."""
        interception = Interception(kind, where, why, undo, self)
        self._installed.append(interception)
        return interception


def _set(obj, name: str, value) -> None:
    """``obj.name = value`` in ``obj``'s own dictionary (``_MISSING``: removed). An instance's
    or a module's is written directly, so that neither a class's ``__setattr__`` nor a
    property can turn the replacement into something else; a class's is read-only, and
    ``setattr`` writes it."""
    if isinstance(obj, type):
        if value is _MISSING:
            if name in vars(obj):
                delattr(obj, name)
        else:
            setattr(obj, name, value)
    elif value is _MISSING:
        vars(obj).pop(name, None)
    else:
        vars(obj)[name] = value


def _name_of(obj) -> str:
    if isinstance(obj, type):
        return obj.__qualname__
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return type(obj).__name__


#: What the process as a whole has installed (``patch_megatron``, the frameworks' ``install``).
PROCESS = Interceptions()


def table(listing) -> str:
    """``listing`` (of one offloader or several) as the Markdown table docs/design.md holds:
    one row per change and reason, the places it is made in, in the order first made."""
    rows: dict[tuple[str, str], list[str]] = {}
    for kind, where, why in listing:
        places = rows.setdefault((kind, why), [])
        if where not in places:
            places.append(where)
    lines = ["| change | where | why |", "|---|---|---|"]
    for (kind, why), places in rows.items():
        lines.append(f"| {kind} | {', '.join(f'`{p}`' for p in places)} | {why} |")
    return "\n".join(lines)
