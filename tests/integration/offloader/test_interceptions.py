"""One way to change an optimizer: everything an offloader installs goes through
``offloader.interceptions``, which lists it (what, where, why); the listing is exactly what
was added to the served objects (their instance attributes and torch hook tables), ``detach``
leaves none of it behind in any mode, and docs/design.md's table is made from it."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[3] / "docs" / "design.md"
BEGIN, END = "<!-- interceptions: begin -->", "<!-- interceptions: end -->"

MODES = {
    "manual": None,
    "gradients": {},
    "fraction and chunked": {"prefetch": 0.5, "chunked_update_bytes": 1 << 18},
    "asleep": {},
}

_HOOK_TABLES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
    "_forward_pre_hooks",
)


def _objects(chunks, optimizer):
    from tests.harness import models

    wrappers = models.megatron_optimizers(optimizer)
    configs = list({id(c.config): c.config for c in chunks}.values())
    return [optimizer, *wrappers, *[w.optimizer for w in wrappers], *configs, *chunks]


def _picture(objects) -> dict:
    """Each object's instance attributes (name -> identity) and hook-table sizes."""
    return {
        index: (
            {name: id(value) for name, value in vars(obj).items()},
            {table: len(getattr(obj, table)) for table in _HOOK_TABLES if hasattr(obj, table)},
        )
        for index, obj in enumerate(objects)
    }


def _added(before, after, objects) -> tuple[set, int]:
    """The instance attributes replaced or added (``Class.name``), and the hooks added."""
    attributes, hooks = set(), 0
    for index, obj in enumerate(objects):
        (names_a, tables_a), (names_b, tables_b) = before[index], after[index]
        for name, ident in names_b.items():
            if names_a.get(name) != ident:
                attributes.add(f"{type(obj).__name__}.{name}")
        hooks += sum(tables_b[t] - tables_a.get(t, 0) for t in tables_b)
    return attributes, hooks


def interceptions_job():
    import megatron_offload
    from tests.harness import models

    chunks, optimizer, config = models.build("gpt", "bf16")
    models.train_step(chunks, optimizer, config, 0)
    objects = _objects(chunks, optimizer)
    found, union = {}, []
    for mode, options in MODES.items():
        before = _picture(objects)
        offloader = (
            megatron_offload.OptimizerStateOffloader(optimizer)
            if options is None
            else megatron_offload.attach(optimizer, **options)
        )
        if mode == "asleep":
            offloader.sleep()
        listing = offloader.interceptions.listing()
        union += listing
        attributes, hooks = _added(before, _picture(objects), objects)
        listed_attributes = {where for kind, where, _ in listing if kind == "attribute"}
        listed_hooks = [where for kind, where, _ in listing if kind == "hook"]
        found[mode] = {
            "attributes": (attributes, listed_attributes),
            # An autograd node's hooks are not on the objects compared here.
            "hooks": (hooks, sum(1 for w in listed_hooks if "accumulator" not in w)),
        }
        offloader.detach()
        found[mode]["after_detach"] = (
            offloader.interceptions.listing(),
            _picture(objects) == before,
        )
    from megatron_offload.interceptions import table

    found["table"] = table(union)
    return found


def test_the_listing_is_what_was_installed_and_detach_removes_it(rank_pool):
    found = rank_pool.run(interceptions_job)[0]
    for mode in MODES:
        figures = found[mode]
        attributes, listed = figures["attributes"]
        assert attributes == listed, (mode, attributes ^ listed)
        hooks, listed_hooks = figures["hooks"]
        assert hooks == listed_hooks > 0, mode
        assert any(where.endswith(".state") for where in listed)  # the guarded mapping
        assert figures["after_detach"] == ([], True), mode
    text = DOCS.read_text()
    documented = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()
    assert documented == found["table"], (
        "docs/design.md's table of interceptions is not what an offloader installs; "
        "replace it with:\n" + found["table"]
    )


def test_a_change_made_outside_the_component_is_caught():
    """Negative control of the comparison above: an attribute set by hand is not listed."""

    class Target:
        pass

    from megatron_offload.interceptions import Interceptions

    target, installed = Target(), Interceptions()
    objects = [target]
    before = _picture(objects)
    installed.replace(target, "step", len, why="listed")
    target.hidden = 1  # by hand
    attributes, _ = _added(before, _picture(objects), objects)
    listed = {where for kind, where, _ in installed.listing() if kind == "attribute"}
    assert attributes - listed == {"Target.hidden"}
    installed.remove_all()
    assert vars(target) == {"hidden": 1}
