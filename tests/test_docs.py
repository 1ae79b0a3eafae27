"""The documentation's own links resolve: every relative link of the README, the CHANGELOG and docs/
(the journal under docs/notes/ included) names a file of the repository, and docs/index.md lists every
page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_relative_links_name_files_that_exist():
    broken = []
    for page in pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n  " + "\n  ".join(broken)


def test_the_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    listed = {(ROOT / "docs" / t.split("#", 1)[0]).resolve() for t in LINK.findall(index)}
    missing = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "docs").rglob("*.md"))
        if p.name != "index.md" and p.resolve() not in listed
    ]
    assert not missing, f"pages docs/index.md does not list: {missing}"
