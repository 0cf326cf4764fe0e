"""Holders and re-pointing (adapters/holders.py): the one way code outside the step points the
optimizer at other tensors for a while and puts its own back."""

from __future__ import annotations

import types

import torch

from megatron_offload.adapters.holders import Holder, Repointing, items_of, same_kind


def test_a_holder_is_a_dict_entry_a_list_item_or_an_attribute():
    entries, items, owner = {"k": 1}, [1, 2], types.SimpleNamespace(a=1)
    for holder in (Holder(entries, "k"), Holder(items, 1), Holder(owner, "a")):
        holder.set("new")
        assert holder.get() == holder.peek() == "new"
    assert entries == {"k": "new"} and items == [1, "new"] and owner.a == "new"
    assert Holder({}, "gone").peek() is None
    assert [h.get() for h in items_of([[1, 2], [3]])] == [1, 2, 3]


def test_points_and_puts_back_where_the_stand_in_still_is():
    a, b, c = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    entries, items, owner = {"exp_avg": a}, [b], types.SimpleNamespace(_data=c)
    views = {id(a): torch.ones(2), id(b): torch.ones(2), id(c): torch.ones(2)}
    pointed = Repointing()
    pointed.point_items(
        [Holder(entries, "exp_avg"), Holder(items, 0), Holder(owner, "_data")], views
    )
    assert len(pointed) == 3 and entries["exp_avg"] is views[id(a)]
    assert pointed.original(views[id(b)]) is b and pointed.stands_in(views[id(c)])
    assert pointed.stand_in_ids() == {id(v) for v in views.values()}
    replacement = torch.full((2,), 7.0)
    items[0] = replacement  # the block put another tensor there
    replaced = pointed.restore()
    assert entries["exp_avg"] is a and owner._data is c
    assert items[0] is replacement  # left as the block made it...
    assert [(holder.container, found) for holder, _, _, found in replaced] == [
        (items, replacement)
    ]  # ... and reported


def test_always_puts_every_original_back():
    a = torch.zeros(2)
    entries = {"exp_avg": a}
    pointed = Repointing()
    view = torch.ones(2)
    pointed.point(Holder(entries, "exp_avg"), view)
    entries["exp_avg"] = new = torch.full((2,), 3.0)  # SOAP: a new tensor in its place
    ((holder, original, stand_in, found),) = pointed.restore(always=True)
    assert entries["exp_avg"] is a and original is a and stand_in is view and found is new


def test_keys_and_rebuilt_lists_go_back_too():
    master, other = torch.zeros(2), torch.zeros(3)
    state = {master: {"exp_avg": 1}, other: {"exp_avg": 2}}
    params = [master, other]
    view = torch.ones(2)
    pointed = Repointing()
    pointed.point_items(items_of([params]), {id(master): view})
    pointed.rekey(state, {id(master): view})
    assert list(state) == [view, other] and params[0] is view
    rebuilt = [view, other]  # a load rebuilt the param group around the stand-in
    pointed.restore(lists=[rebuilt], mapping=state)
    assert list(state) == [master, other] and params[0] is master and rebuilt[0] is master
    pointed.forget()
    assert not pointed.stands_in(view) and len(pointed) == 0


def test_recorded_holders_report_what_someone_else_put_there():
    a = torch.zeros(2)
    entries = {"exp_avg": a}
    watch = Repointing()
    watch.record(Holder(entries, "exp_avg"))
    assert list(watch.changed()) == []
    entries["exp_avg"] = b = torch.zeros(2)
    ((holder, original, _, found),) = list(watch.changed())
    assert original is a and found is b and [i[3] for i in watch.items()] == [b]


def test_same_kind_is_shape_dtype_device_and_a_plain_tensor():
    old = torch.zeros(2, 3)
    assert same_kind(torch.ones(2, 3), old) and same_kind(torch.nn.Parameter(torch.ones(2, 3)), old)
    assert not same_kind(torch.ones(3, 2), old) and not same_kind(torch.ones(2, 3).double(), old)
    assert not same_kind("tensor", old)
