"""The README stays a quickstart whose first two commands are scripts/run and scripts/test,
every link of the README and the guides under docs/ leads somewhere (a file of the tree,
and a heading of it where the link names one: GitHub's anchors), and every upipe command
and flag they show is one the binary has (its `--help`), so the docs cannot drift from it.

run: UPIPE_BINARY=build/upipe python3 -m pytest tests/python/test_docs.py
(ctest's `docs` test passes the binary it built; without one the flag checks skip)
"""
import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

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


# The commands and flags the docs show, against the binary's own `--help`.

FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
SHELL = {"", "sh", "bash", "shell", "console"}
LAUNCHERS = {"mpirun", "mpiexec", "srun", "torchrun", "nice", "time", "env", "exec", "sudo", "numactl", "timeout"}
HELP_OPTION = re.compile(r"^  (-[^\s,]*(?:,\s?-[^\s,]*)*)", re.M)
FLAG = re.compile(r"--[a-zA-Z][\w-]*")


def binary():
    named = os.environ.get("UPIPE_BINARY")
    path = Path(named) if named else ROOT / "build" / "upipe"
    if not path.is_file():
        pytest.skip(f"no upipe binary at {path} (build it, or set UPIPE_BINARY)")
    return path


@functools.lru_cache(maxsize=None)
def help_text(command):
    args = [str(binary()), *([command] if command else []), "--help"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(args[1:])}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


@functools.lru_cache(maxsize=None)
def commands():
    """The subcommands `upipe --help` lists (CLI11: the lines under "Subcommands:")."""
    listed = help_text(None).split("Subcommands:", 1)[1]
    return frozenset(m.group(1) for m in re.finditer(r"^  ([a-z][\w-]*)\s", listed, re.M))


@functools.lru_cache(maxsize=None)
def flags(command):
    """The long flags a command's --help lists as options (CLI11's and argparse's layouts)."""
    names = set()
    for m in HELP_OPTION.finditer(help_text(command)):
        names.update(FLAG.findall(m.group(1)))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def every_flag():
    out = set(flags(None))
    for command in commands():
        out |= flags(command)
    return frozenset(out)


def program_of(word):
    """The upipe command a word runs (None: not upipe): the binary, or scripts/run (train)."""
    word = word.strip("\"'")
    if word == "scripts/run":
        return "train"
    return "" if word == "upipe" or word.endswith("/upipe") else None


def check_segment(words, where, problems, loose=False):
    """One simple command: `upipe CMD --flag ...` is checked against CMD's flags; a flag outside
    an upipe command (a table row, prose) against every command's. Other programs' are theirs."""
    words = [w for w in words if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]  # VAR=value before the program
    for i, word in enumerate(words):
        command = program_of(word)
        if command is not None:
            break
        if i == 0 and word.startswith("-"):
            if loose:
                return
            command = "*"  # a flag on its own: some command's
            break
        if i == 0 and word not in LAUNCHERS or word.startswith("#"):
            return  # another program (scripts/build, python3, cmake, an #SBATCH line) or prose
    else:
        return
    rest = words[i:] if command == "*" else words[i + 1:]
    if command == "" and rest and not rest[0].startswith("-"):
        if rest[0].strip("\"'") not in commands() and words[i] == "upipe":
            return  # "upipe" the strategy (a table's row, prose), not the binary
        command = rest[0].strip("\"'")
        if command not in commands():
            problems.append(f"{where}: `upipe {command}`: no such command (upipe --help lists {sorted(commands())})")
            return
        rest = rest[1:]
    known = every_flag() if command == "*" else flags(command or None)
    if command == "" and any(FLAG.match(w) and FLAG.match(w).group() not in flags(None) for w in rest):
        known = every_flag()  # `upipe --seq-chunks N` names the strategy with a flag, not a command line
    for word in rest:
        m = FLAG.match(word.strip("\"'("))
        if m and m.group() not in known:
            shown = f"upipe {command}" if command not in ("", "*") else "any upipe command"
            problems.append(f"{where}: {m.group()} is not a flag of {shown}")


def drift(text, name, loose=False):
    """What the text shows that the binary lacks: unknown commands and flags, one line each.
    loose: upipe's command lines only (a reference's prose names nvcc's flags, or ones to come)."""
    problems = []
    for lang, body in FENCE.findall(text):
        if lang not in SHELL:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line)
            for segment in re.split(r"&&|\|\||;|\||&(?=\s|$)", line):
                check_segment(segment.split(), f"{name}: {segment.strip()}", problems, loose)
    outside = FENCE.sub("", text)
    for span in SPAN.findall(outside):
        for segment in re.split(r"&&|;", span.replace("\\|", "|")):
            check_segment(segment.split(), f"{name}: `{segment.strip()}`", problems, loose)
    return problems


# The reference and the record: design.md and reliability.md are held to upipe's command
# lines only; benchmarks.md's dated log keeps each command as it was run, so it is not held.
REFERENCES = {"design.md", "reliability.md"}
RECORDS = {"benchmarks.md"}


def test_every_command_and_flag_the_docs_show_is_the_binarys():
    problems = []
    for doc in DOCS:
        if doc.name not in RECORDS:
            problems += drift(doc.read_text(), str(doc.relative_to(ROOT)), loose=doc.name in REFERENCES)
    assert not problems, "\n".join(problems)


def test_a_flag_or_command_the_binary_lacks_is_found():
    made_up = ("```sh\nbuild/upipe train --steps 5 --no-such-flag 3   # a comment --not-checked\n"
               "mpirun -np 2 build/upipe plan --gpus 2 --steps 9\nbuild/upipe no-such-command --x\n```\n"
               "A row: `--seq-len 64K`, `--made-up-flag`; `scripts/run --made-up-too`; `cmake --its-own`.\n"
               "| upipe | cpu | 512 |\n```\nupipe    meta   131072\n```\n")
    found = drift(made_up, "made-up")
    assert any("--no-such-flag is not a flag of upipe train" in p for p in found), found
    assert any("--steps is not a flag of upipe plan" in p for p in found), found
    assert any("`upipe no-such-command`: no such command" in p for p in found), found
    assert any("--made-up-flag is not a flag of any upipe command" in p for p in found), found
    assert any("--made-up-too is not a flag of upipe train" in p for p in found), found
    assert len(found) == 5, found  # --seq-len, the comment, cmake's flag and the strategy's rows pass
    assert drift(made_up, "made-up", loose=True) == [p for p in found if "any upipe command" not in p]


def test_every_run_toml_shown_is_the_readmes():
    """tests/apps/resume_cli_test.cpp (readme.the_run_toml_works_in_an_empty_directory) runs
    the README's run.toml; a guide that shows a run.toml shows that one."""
    blocks = [(str(doc.relative_to(ROOT)), body) for doc in DOCS for lang, body in FENCE.findall(doc.read_text())
              if lang == "toml" and body.startswith("# run.toml\n")]
    assert blocks and blocks[0][0] == "README.md", "the README shows no run.toml"
    for name, body in blocks[1:]:
        assert body == blocks[0][1], f"{name}'s run.toml is not the README's"
