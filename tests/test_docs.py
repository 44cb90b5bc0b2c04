"""The docs stay true to the code: docs/cli.md is every command's current `--help`, the README stays
short enough to read in five minutes and names every command, and no relative link is broken."""

from __future__ import annotations

import re
from pathlib import Path

import click

from autotune.cli.reference import COMMAND, cli_reference, command_contexts

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 15_000

LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # ](target) and ](target "title")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def test_the_command_reference_is_current():
    assert (ROOT / "docs" / "cli.md").read_text() == cli_reference(), (
        f"docs/cli.md differs from the commands' --help: run `{COMMAND}`"
    )


def test_the_readme_is_short():
    size = len(README.read_bytes())
    assert size < README_LIMIT, f"README.md is {size:,} bytes, over {README_LIMIT:,}: move reference to docs/"


def relative_links(page: Path) -> list[str]:
    """The page's link and image targets that name a file here (code blocks, URLs and anchors aside)."""
    text = FENCE.sub("", page.read_text())
    targets = (t.split("#", 1)[0] for t in LINK.findall(text))
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_relative_links_point_at_files():
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in PAGES
        for target in relative_links(page)
        if not (page.parent / target).exists()
    ]
    assert not broken, "broken links: " + "; ".join(broken)


def test_the_link_checker_sees_links():
    """A checker that finds no link passes whatever the pages say."""
    assert "docs/cli.md" in relative_links(README)
    assert "cpu-demo.png" in relative_links(ROOT / "docs" / "measurements.md")


def command_table() -> list[str]:
    """The first cell of each row of the README's table under `## Commands`."""
    section = README.read_text().split("\n## Commands\n", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # header and rule aside
    return [re.split(r"(?<!\\)\|", row)[1] for row in rows]


def test_every_command_is_in_the_readme_command_table():
    cells = command_table()
    commands = [ctx.command_path for ctx in command_contexts() if not isinstance(ctx.command, click.Group)]
    assert len(commands) >= 12
    missing = [path for path in commands if not any(re.search(rf"`{re.escape(path)}[ `]", cell) for cell in cells)]
    assert not missing, f"commands missing from README.md's command table: {missing}"
