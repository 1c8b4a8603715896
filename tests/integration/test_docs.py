"""The documentation's code runs as written. Every ```python block of README.md, docs/ and the public docstrings
(the API pages) is a program, run here in a fresh interpreter as ``python NAME.py``, or visibly a fragment. Its
title, which the site shows above it, says which:

- ``title="NAME.py"``: a complete program, which must exit with 0 (``"NAME.py (CUDA)"``: where a CUDA device is;
  a module it imports that is not installed, e.g. optuna, skips it). A ```text block titled "Output" right after
  it is what it prints: each of its lines must be in its output;
- a title that starts with "Fragment": part of a program (names it does not define, ``...``); it must still be
  valid Python.

Every code block also fits the site's content column: 80 characters (Material at 1280 pixels), 76 in an API
docstring's example (an admonition's padding).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import mplaunch
from tests.helpers import REPO, run_script

PROGRAM = re.compile(r"(?P<name>[\w-]+\.py)(?P<cuda> \(CUDA\))?")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
#: The content column's width in monospace characters: a page's, and an API example's.
PAGE_COLUMNS, DOCSTRING_COLUMNS = 80, 76


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its title, its code, and the block right after it."""

    where: str
    language: str
    title: str
    code: str
    columns: int
    output: str | None = None  # the code of a ```text block titled "Output" right after it


def fenced(text: str, where: str, columns: int) -> list[Block]:
    """The fenced blocks of a Markdown text (``where``: file or object, for messages)."""
    lines = text.splitlines()
    found: list[tuple[int, int, Block]] = []  # first and last line, block
    index = 0
    while index < len(lines):
        start = FENCE.match(lines[index])
        if start is None:
            index += 1
            continue
        indent, fence, info = len(start["indent"]), start["fence"], start["info"].strip()
        end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == fence)
        title = re.search(r'title="([^"]*)"', info)
        code = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
        found.append(
            (index, end, Block(f"{where}:{index + 1}", info.split(" ")[0], title[1] if title else "", code, columns))
        )
        index = end + 1
    blocks = [block for _, _, block in found]
    for number, (_, end, block) in enumerate(found[:-1]):
        first, _, after = found[number + 1]
        adjacent = not any(line.strip() for line in lines[end + 1 : first])
        if adjacent and after.language == "text" and after.title == "Output":
            blocks[number] = dataclasses.replace(block, output=after.code)
    return blocks


def public_docstrings() -> Iterator[tuple[str, str]]:
    """The docstrings the API pages render: each public object's, and its members' (by qualified name)."""
    for name in mplaunch.__all__:
        obj = getattr(mplaunch, name)
        yield f"mplaunch.{name}", inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                function = value.fget if isinstance(value, property) else value
                if callable(function) and (doc := inspect.getdoc(function)):
                    yield f"mplaunch.{name}.{member}", doc


def all_blocks() -> list[Block]:
    """Every fenced block of README.md, docs/ and the public docstrings."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    blocks = [b for f in files for b in fenced(f.read_text(), str(f.relative_to(REPO)), PAGE_COLUMNS)]
    for where, doc in public_docstrings():
        blocks += fenced(doc, where, DOCSTRING_COLUMNS)
    return blocks


BLOCKS = all_blocks()
PYTHON = [block for block in BLOCKS if block.language in ("python", "py", "pycon")]


def programs() -> list[object]:
    """One test case per distinct program (README's quick start is also the docs home's)."""
    seen: dict[str, Block] = {}
    for block in PYTHON:
        if PROGRAM.fullmatch(block.title) and block.code not in seen:
            seen[block.code] = block
    return [
        pytest.param(block, id=block.title, marks=[pytest.mark.cuda] if "(CUDA)" in block.title else [])
        for block in seen.values()
    ]


def test_every_python_block_is_a_program_or_a_fragment() -> None:
    wrong = [
        f'{block.where}: title {block.title!r}: say title="NAME.py" (a program) or title="Fragment: ..."'
        for block in PYTHON
        if not PROGRAM.fullmatch(block.title) and not block.title.startswith("Fragment")
    ]
    assert not wrong, "\n".join(wrong)
    assert len([block for block in PYTHON if PROGRAM.fullmatch(block.title)]) >= 10  # it found the programs


def test_fragments_are_valid_python_and_programs_are_complete() -> None:
    problems = []
    for block in PYTHON:
        try:
            tree = ast.parse(block.code, block.where)
        except SyntaxError as error:
            problems.append(f"{block.where}: not valid Python: {error}")
            continue
        ellipses = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value is Ellipsis]
        if PROGRAM.fullmatch(block.title) and ellipses:
            problems.append(f"{block.where}: a program with `...` in it: complete it, or call it a fragment")
    assert not problems, "\n".join(problems)


def test_code_blocks_fit_the_content_column() -> None:
    too_wide = [
        f"{block.where}: a line of {len(line)} characters: {line.strip()[:60]!r} (at most {block.columns})"
        for block in BLOCKS
        if not block.where.startswith("README.md") or block.language in ("python", "text")  # README's are GitHub's
        for line in block.code.splitlines()
        if len(line) > block.columns
    ]
    assert not too_wide, "\n".join(too_wide)


@pytest.mark.parametrize("block", programs())
def test_program_runs_as_written(block: Block, tmp_path: Path) -> None:
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(block.code))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    for module in sorted(imported):
        if module and importlib.util.find_spec(module) is None:
            pytest.skip(f"{block.where} imports {module}, which is not installed")
    script = tmp_path / PROGRAM.fullmatch(block.title)["name"]  # type: ignore[index]
    script.write_text(block.code)
    done = run_script(script, timeout=240)
    assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    for line in (block.output or "").splitlines():
        assert line in done.stdout, f"{block.where}: {line!r} is not in its output:\n{done.stdout}"
