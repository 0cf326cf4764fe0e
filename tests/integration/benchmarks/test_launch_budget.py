"""``benchmarks.launch_budget`` on 2 gloo ranks: one steady step's device work, plain against
attached, for every mode (each prefetch point, the chunked update, after a sleep, with a
checkpoint served between steps). The offloader's addition is bounded by pieces and chunks,
does not grow with the number of tensors (2 against 4 layers), and adds no host
synchronization; a planted per-tensor operation breaks the budget (negative control)."""

from __future__ import annotations


def test_every_mode_stays_within_the_launch_budget(rank_pool):
    from benchmarks.launch_budget import MODES, measure, over_budget, report

    rows = measure(rank_pool)
    assert {row["mode"] for row in rows} == set(MODES)
    assert over_budget(rows) == [], report(rows)
    for row in rows:
        if row["mode"] != "chunked":
            # The whole-state cycle: a few operations per piece, whatever the tensors (and a
            # model that slept costs its steps nothing more).
            assert row["added_launches"] == rows[0]["added_launches"] > 0, report(rows)
    assert "added launches" in report(rows)


def test_a_planted_per_tensor_operation_breaks_the_budget(rank_pool):
    from benchmarks.launch_budget import measure, over_budget

    rows = measure(rank_pool, modes=("prefetch=gradients",), plant=("per-tensor",))
    problems = over_budget(rows)
    assert any("more parameters" in problem for problem in problems), problems
