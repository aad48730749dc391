"""The operator documentation says only what is real.

Every relative link in the README, the changelog and docs/ leads to a file (and heading) of
the checkout; every ``infersight <command>`` the README names exists; the README's config
snippet is accepted by the agent's own loader and builds the sinks it names; and no text is
left that only made sense while the project was being built.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infersight.agent.cli import COMMANDS
from infersight.agent.commands.compose import build_exporters
from infersight.agent.daemon import config as cfg

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, REPO / "CHANGELOG.md", REPO / "deploy" / "kubernetes" / "README.md",
         *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```(\w*)\n(.*?)^\s*```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        missing_anchor = bool(anchor) and dest.suffix == ".md" and dest.exists() and anchor not in anchors(dest)
        if not dest.exists() or missing_anchor:
            broken.append(target)
    assert broken == []


def test_every_command_named_in_the_readme_exists() -> None:
    text = README.read_text()
    code = [body for _, body in FENCE.findall(text)] + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    named = {m for snippet in code for m in re.findall(r"(?:^|[\s/])infersight ([a-z][a-z-]+)", snippet, re.M)}
    assert {"launch", "status", "hooks", "install-service"} <= named
    assert named <= {name for name, _, _ in COMMANDS}, named - {name for name, _, _ in COMMANDS}


def test_the_readme_config_snippet_is_accepted(tmp_path: Path) -> None:
    blocks = [body for lang, body in FENCE.findall(README.read_text()) if lang == "toml"]
    assert blocks, "the README lost its sink example"
    for body in blocks:
        path = tmp_path / "infersight.toml"
        path.write_text(body)
        conf = cfg.load(str(path), env={}, require_file=True)
        sections = set(re.findall(r"^\[exporters\.(\w+)\]", body, re.M))
        assert sections <= {e.name for e in build_exporters(conf, env={})}


@pytest.mark.parametrize("page", [README, REPO / "CHANGELOG.md", REPO / "docs" / "benchmarks.md",
                                  REPO / "docs" / "architecture.md"], ids=lambda p: p.name)
def test_no_text_that_only_made_sense_while_building(page: Path) -> None:
    text = page.read_text()
    for phrase in ("this round", "last round", "rounds ago", "DESIGN", "this VM", "after the merges"):
        assert phrase not in text, phrase


def test_every_tests_path_the_pages_name_exists() -> None:
    """A test file, helper or fixture the pages point at (``tests/e2e/test_launch.py``,
    ``tests/support/workloads/serving_*.py``) is where they say: tests move by kind."""
    missing = []
    for page in PAGES:
        for m in re.finditer(r"(?<![\w/.])tests/[\w/.*-]*", page.read_text()):
            path = m.group(0).rstrip(".")
            if not (any(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append("%s: %s" % (page.relative_to(REPO), path))
    assert missing == []
