"""Reading the offloader's log line back (``megatron_offload.report.format_offload_stats``):
the functional tests check the figures a pretrain run printed, and the GPU kit's report
collects them. Not part of the package: nothing in a training run parses its own log."""

from __future__ import annotations

import re

from megatron_offload.report import GIB, UNITS

#: A size as ``human_bytes`` writes it.
SIZE_PATTERN = r"[0-9.]+ (?:" + "|".join(UNITS) + ")"

_LOG_LINE = re.compile(
    r"\[optimizer-state offload\] iteration +(?P<iteration>\d+) \| "
    rf"offloaded: (?P<offloaded>{SIZE_PATTERN}) \| host: (?P<host>{SIZE_PATTERN}) \|"
    r"(?: D2H: (?P<d2h_ms>[0-9.]+) ms \((?P<d2h_gbps>[0-9.]+) GB/s\) \|)?"
    r"(?: H2D: (?P<h2d_ms>[0-9.]+) ms \((?P<h2d_gbps>[0-9.]+) GB/s\) \|)?"
    r" exposed: (?P<exposed_ms>[0-9.]+) ms \| issue: (?P<issue_ms>[0-9.]+) ms \|"
    r"(?: checkpoint wait: (?P<checkpoint_wait_ms>[0-9.]+) ms \|)?"
    r"(?: \(max over (?P<ranks>\d+) ranks[^)]*\))?"
)


def parse_bytes(text: str) -> float:
    """The bytes of a size written by ``human_bytes``."""
    number, unit = text.split()
    return float(number) * 1024 ** UNITS.index(unit)


def parse_log_lines(log: str) -> list[dict]:
    """The figures of every log line in ``log``, in order (``offload_figures``' keys, plus
    ``iteration`` and ``ranks``); a figure the line omits (not yet measured) is 0.0."""
    rows = []
    for match in _LOG_LINE.finditer(log):
        found = match.groupdict()
        row = {"iteration": int(found.pop("iteration")), "ranks": int(found.pop("ranks") or 1)}
        row["offloaded_gib"] = parse_bytes(found.pop("offloaded")) / GIB
        row["host_gib"] = parse_bytes(found.pop("host")) / GIB
        row.update({key: float(value or 0.0) for key, value in found.items()})
        rows.append(row)
    return rows
