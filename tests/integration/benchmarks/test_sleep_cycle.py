"""``benchmarks.sleep_cycle`` on 2 gloo ranks: its byte figures add up, and sleep/wake carries
fewer bytes than verl's way and a full copy."""

from __future__ import annotations


def test_sleep_cycle_figures(rank_pool):
    from benchmarks.sleep_cycle import cycle_job, report

    cfg = {"layers": 2, "hidden": 64, "cycles": 2, "frozen": True}
    results = rank_pool.run(cycle_job, cfg)
    for result in results:
        model = result["model"]
        for cycle in result["cycles"]:
            # Rebuilt + copied = every parameter storage; gradients dropped, never copied.
            assert cycle["rebuilt_bytes"] + cycle["copied_parameter_bytes"] == (
                model["parameters"] + model["frozen"]
            )
            assert cycle["copied_parameter_bytes"] == model["frozen"] > 0
            assert cycle["dropped_gradient_bytes"] == model["gradients"]
            states = cycle["verl_link_bytes"] - 2 * (model["parameters"] + model["frozen"])
            assert cycle["link_bytes"] == states + 2 * model["frozen"]
            assert cycle["link_bytes"] < cycle["verl_link_bytes"] < cycle["full_copy_link_bytes"]
        assert result["link_floor_s"] is None  # no accelerator link on the CPU
    text = report(results)
    assert "verl's way" in text and "no time reported" in text
