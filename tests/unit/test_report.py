"""Figures for people: sizes in the unit that fits, figures not yet measured left out, and a
log line the parsers read back."""

import pytest

from megatron_offload import report as stats_log
from megatron_offload_testing import log_lines


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (1000, "1000 B"),
        (1024, "1.000 KiB"),
        (631_808, "617.0 KiB"),
        (12_939_428, "12.34 MiB"),
        (3 << 30, "3.000 GiB"),
        (int(1.5 * (1 << 40)), "1.500 TiB"),
    ],
)
def test_sizes_are_written_in_the_unit_that_keeps_them_under_1024(nbytes, text):
    assert stats_log.human_bytes(nbytes) == text
    assert log_lines.parse_bytes(text) == pytest.approx(nbytes, rel=1e-3)


def _figures(**changes):
    figures = {
        "offloaded_gib": 631_808 / 2**30,
        "host_gib": 631_808 / 2**30,
        "d2h_ms": 0.0,
        "d2h_gbps": 0.0,
        "h2d_ms": 0.0,
        "h2d_gbps": 0.0,
        "exposed_ms": 0.0,
        "issue_ms": 0.25,
        "checkpoint_wait_ms": 0.0,
    }
    figures.update(changes)
    return figures


def test_the_log_line_leaves_out_copies_not_yet_measured_and_parses_back():
    first = stats_log.format_offload_stats(1, _figures(d2h_ms=0.717, d2h_gbps=0.88))
    assert first == (
        " [optimizer-state offload] iteration        1 | offloaded: 617.0 KiB |"
        " host: 617.0 KiB | D2H: 0.717 ms (0.88 GB/s) | exposed: 0.000 ms |"
        " issue: 0.250 ms |"
    )
    assert "H2D" not in first and "checkpoint" not in first and "0.000617" not in first
    later = stats_log.format_offload_stats(
        2,
        _figures(d2h_ms=0.7, d2h_gbps=0.9, h2d_ms=1.0, h2d_gbps=0.6, checkpoint_wait_ms=2.5),
        ranks=2,
    )
    rows = log_lines.parse_log_lines("noise\n" + first + "\n" + later + "\n")
    assert [(r["iteration"], r["ranks"]) for r in rows] == [(1, 1), (2, 2)]
    assert (
        rows[0]["h2d_ms"] == 0.0
        and rows[1]["h2d_ms"] == 1.0
        and rows[1]["checkpoint_wait_ms"] == 2.5
    )
    assert rows[0]["offloaded_gib"] == pytest.approx(631_808 / 2**30, rel=1e-3)


def test_the_summary_is_one_line_with_human_units():
    stats = {
        "offloaded_bytes": 3 << 30,
        "host_bytes": (3 << 30) + (1 << 20),
        "d2h_ms": 120.5,
        "d2h_gbps": 26.73,
        "h2d_ms": 0.0,
        "h2d_gbps": 0.0,
        "exposed_ms": 4.125,
        "cycles": 7,
    }
    assert stats_log.summary(stats) == (
        "offloaded 3.000 GiB | host 3.001 GiB | last D2H 120.500 ms "
        "(26.73 GB/s) | exposed 4.125 ms | 7 cycles"
    )
