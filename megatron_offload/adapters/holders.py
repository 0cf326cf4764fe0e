"""Where an optimizer holds a tracked tensor, and pointing it at another tensor for a while.

Code outside the step sometimes needs the optimizer to use other tensors than its own for a
while and then its own again: a host view puts CPU tensors viewing the host copy where the
released tensors are (checkpoints served from the host), the chunked update puts views of a
device slot where a chunk's states are, and the state watch puts a tensor the optimizer
replaced back into the one the engine tracks (SOAP's steps). All three use this module.

A tracked tensor is held in one of these places (a ``Holder``):

* an entry of a parameter's state dict (``state[param]["exp_avg"]``);
* an attribute of a quantized state (the ``_data`` of Transformer Engine's ``Float8Tensor``);
* an item of a list: a param group's ``params``, the wrapper's lists of master weights;
* a key of the state mapping (the parameter shards, which are the master weights of a bf16
  model: ``state[master]``).

``Repointing`` points holders at stand-ins and puts the originals back, saying where it
found something else than its stand-in (the block replaced it: a load, an optimizer that
makes new tensors).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..engine.pieces import is_plain


class Holder:
    """One place an optimizer holds a tensor: ``container[key]`` for a dict or a list, the
    attribute ``key`` of any other object."""

    __slots__ = ("container", "key")

    def __init__(self, container, key) -> None:
        self.container, self.key = container, key

    def get(self):
        if isinstance(self.container, (dict, list)):
            return self.container[self.key]
        return getattr(self.container, self.key)

    def set(self, value) -> None:
        if isinstance(self.container, (dict, list)):
            self.container[self.key] = value
        else:
            setattr(self.container, self.key, value)

    def peek(self):
        """The value, or None where the place is gone (a dict entry someone removed)."""
        if isinstance(self.container, dict):
            return self.container.get(self.key)
        return self.get()


def items_of(lists: Iterable[list]) -> Iterator[Holder]:
    """A holder for every item of every list (param groups' ``params``, master lists)."""
    for tensors in lists:
        for index in range(len(tensors)):
            yield Holder(tensors, index)


class Repointing:
    """Holders pointed at stand-ins, and their originals, to be put back by ``restore``.

    The chunked update points and restores a chunk's states around every update call, so the
    dict, list and attribute operations are done here in line, not through ``Holder``'s
    methods (a Python call per tensor and direction)."""

    def __init__(self) -> None:
        self._pointed: list[tuple[Holder, object, object]] = []  # (holder, original, stand-in)
        self._originals: dict[int, object] = {}  # id(stand-in) -> original
        self._stand_ins: list[object] = []  # held, so that no id is reused meanwhile

    def __len__(self) -> int:
        return len(self._pointed)

    def original(self, value):
        """The original ``value`` stands in for (``value`` itself if none)."""
        return self._originals.get(id(value), value)

    def stands_in(self, value) -> bool:
        return id(value) in self._originals

    def stand_in_ids(self) -> set[int]:
        """The ids of every stand-in put anywhere."""
        return set(self._originals)

    def record(self, holder: Holder) -> None:
        """Remember what ``holder`` holds now, without pointing it elsewhere: ``changed``
        then says whether someone else put another tensor there."""
        value = holder.get()
        self._pointed.append((holder, value, value))

    def point(self, holder: Holder, stand_in) -> None:
        """``holder`` holds ``stand_in`` until ``restore``."""
        self.point_many(((holder, stand_in),))

    def point_many(self, pairs) -> None:
        """``point`` for every ``(holder, stand_in)`` of ``pairs``."""
        pointed, originals, stand_ins = self._pointed, self._originals, self._stand_ins
        for holder, stand_in in pairs:
            container, key = holder.container, holder.key
            if isinstance(container, (dict, list)):
                original = container[key]
                container[key] = stand_in
            else:
                original = getattr(container, key)
                setattr(container, key, stand_in)
            pointed.append((holder, original, stand_in))
            originals[id(stand_in)] = original
            stand_ins.append(stand_in)

    def point_items(self, holders: Iterable[Holder], stand_ins: dict[int, object]) -> None:
        """Point every holder whose tensor has a stand-in (``{id(original): stand_in}``)."""
        pairs = []
        for holder in holders:
            value = holder.get()
            stand_in = stand_ins.get(id(value)) if value is not None else None
            if stand_in is not None:
                pairs.append((holder, stand_in))
        self.point_many(pairs)

    def rekey(self, mapping: dict, stand_ins: dict[int, object]) -> None:
        """The keys of ``mapping`` that have a stand-in replaced by it, in the same order
        (dict's own methods: a guarded mapping's accessors are not involved)."""
        items = list(dict.items(mapping))
        dict.clear(mapping)
        for key, value in items:
            stand_in = stand_ins.get(id(key))
            if stand_in is not None:
                self._originals[id(stand_in)] = key
                self._stand_ins.append(stand_in)
                key = stand_in
            dict.__setitem__(mapping, key, value)

    def items(self) -> Iterator[tuple[Holder, object, object, object]]:
        """``(holder, original, stand-in, found now)`` for every holder pointed or recorded."""
        for holder, original, stand_in in self._pointed:
            yield holder, original, stand_in, holder.peek()

    def changed(self) -> Iterator[tuple[Holder, object, object, object]]:
        """``items()`` where the holder holds something else than what was put there (or
        recorded)."""
        for item in self.items():
            if item[3] is not item[2]:
                yield item

    def restore(
        self, *, always: bool = False, lists: Iterable[list] = (), mapping: dict | None = None
    ) -> list:
        """Put every original back where its stand-in still is (``always``: wherever it was
        pointed, whatever is there now); returns ``(holder, original, stand-in, found)`` of
        every holder that held something else than its stand-in. Without ``always``, what
        the block replaced is left as the block made it.

        ``lists``: more lists to look through for stand-ins (a load may have rebuilt the
        param groups around them); ``mapping``: the state mapping whose stand-in keys go back
        (the optimizer's mapping now, which a load may have replaced).
        """
        replaced = []
        for holder, original, stand_in in reversed(self._pointed):
            container, key = holder.container, holder.key
            if isinstance(container, dict):
                found = container.get(key)
            elif isinstance(container, list):
                found = container[key]
            else:
                found = getattr(container, key)
            if found is not stand_in:
                replaced.append((holder, original, stand_in, found))
            if original is not stand_in and (always or found is stand_in):
                if isinstance(container, (dict, list)):
                    container[key] = original
                else:
                    setattr(container, key, original)
        replaced.reverse()
        originals = self._originals
        for holder in items_of(lists):
            value = holder.get()
            if value is not None and id(value) in originals:
                holder.set(originals[id(value)])
        if mapping is not None:
            items = list(dict.items(mapping))
            dict.clear(mapping)
            for key, value in items:
                dict.__setitem__(mapping, originals.get(id(key), key), value)
        self._pointed = []
        return replaced

    def forget(self) -> None:
        """Drop every reference (nothing is put back)."""
        self._pointed, self._originals, self._stand_ins = [], {}, []


def same_kind(new, old: torch.Tensor) -> bool:
    """``new`` is a plain tensor that can take ``old``'s place: same shape, dtype, device."""
    return (
        is_plain(new)
        and new.shape == old.shape
        and new.dtype == old.dtype
        and new.device == old.device
    )
