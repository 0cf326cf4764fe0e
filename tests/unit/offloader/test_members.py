"""What each served optimizer's operations select: resident()'s kinds, checked and spread per optimizer."""

from __future__ import annotations

import pytest


def test_resident_kinds_are_checked():
    import functools

    from megatron_offload.offloader.members import resident_selection

    select = functools.partial(resident_selection, count=2)
    assert select(None) == [("optimizer_states", "master_weights")] * 2
    assert select("master_weights") == [("master_weights",)] * 2
    assert select([("master_weights",), ()]) == [("master_weights",), ()]
    with pytest.raises(ValueError, match="unknown kind"):
        select(("moments",))
    with pytest.raises(ValueError, match="3 selections for 2 optimizers"):
        select([(), (), ()])
