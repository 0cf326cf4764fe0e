"""The user's landing page stays one: short, the install line and the flag early, every link
pointing at a file that exists, and the log line it shows the one the code prints."""

import re
from pathlib import Path

from megatron_offload_testing.log_lines import parse_log_lines

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "examples" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_the_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    assert any("pip install" in line for line in lines[:40])
    assert any("--offload-optimizer-states" in line for line in lines[:100])


def test_every_relative_link_points_at_a_file():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(REPO)} -> {target}")
    assert missing == []


def test_the_documented_log_lines_are_what_the_parser_reads():
    for page in (REPO / "README.md", REPO / "docs" / "pretrain.md"):
        shown = [
            line for line in page.read_text().splitlines() if "[optimizer-state offload]" in line
        ]
        assert shown and len(parse_log_lines("\n".join(shown))) == len(shown), page
