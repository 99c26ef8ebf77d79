"""The README stays a quickstart whose first two commands are scripts/run and scripts/test,
and every link of the README and the guides under docs/ leads somewhere: a file of the
tree, and a heading of it where the link names one (GitHub's anchors).

run: python3 -m pytest tests/python/test_docs.py
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def anchors(path):
    out, seen = set(), {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        a = anchor(line.lstrip("#"))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def test_the_readme_is_a_quickstart_led_by_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    first_block = text.split("```", 2)[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line.strip()]
    assert commands[:2] == ["scripts/run", "scripts/test"]
    for script in ("scripts/run", "scripts/test"):
        assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"


def test_every_link_leads_to_a_file_and_a_heading():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_guide_is_linked_from_the_guides_index():
    index = (ROOT / "docs" / "README.md").read_text()
    for doc in DOCS[1:]:
        if doc.name != "README.md":
            assert f"]({doc.name})" in index, f"docs/README.md does not link {doc.name}"
