"""The README and the CHANGELOG stand alone: every relative link resolves inside the repository
(the docs site's own links are checked by `mkdocs build --strict`), and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"```.*?```", re.S)


def _anchors(page: Path) -> set[str]:
    """The heading ids mkdocs (Python-Markdown's toc) gives a page's headings."""
    heads = re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h.strip().lower())) for h in heads}


def _broken(doc: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve()
        if not dest.is_relative_to(ROOT) or not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    return broken


def test_readme_and_changelog_links_resolve_inside_the_repository() -> None:
    for name in ("README.md", "CHANGELOG.md"):
        assert _broken(ROOT / name) == [], name


def test_the_check_refuses_links_outside_the_repository_and_missing_pages(tmp_path: Path) -> None:
    fake = tmp_path / "x.md"
    fake.write_text("[a](/etc/hostname) [b](nope.md) [c](https://example.org) [d](#top)")
    assert _broken(fake) == ["/etc/hostname", "nope.md"]
    own = ROOT / "README.md"
    assert "../shared/" not in own.read_text()  # the repository stands alone


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
