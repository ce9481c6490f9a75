"""The README's first screen says how to install, run the demo, serve, validate and test; every
relative link of the README and docs/ leads to a file, and every #anchor to a heading, that exists."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").glob("*/README.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())  # headings, not comments in code blocks
    return {slug(m[1]) for m in re.finditer(r"(?m)^#+ (.+)$", text)}


def test_the_first_screen_holds_install_demo_serve_validate_and_test():
    first = (ROOT / "README.md").read_text().splitlines()[:60]
    headings = [line for line in first if line.startswith("## ")]
    assert headings == ["## Install", "## Run the demo", "## Serve", "## Validate", "## Test"]
    text = "\n".join(first)
    for command in ("make venv", "make demo", "neuron-moe serve", "neuron-moe validate", "make test"):
        assert command in text, command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: {target}: no {file}"
        if anchor:
            assert anchor in anchors(file), f"{page.name}: {target}: no heading #{anchor} in {file.name}"
