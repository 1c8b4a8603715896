"""MkDocs hook: the options reference, rendered from its one source, the fields of ``ParallelConfig``.

Each option's text is its attribute docstring in ``mplaunch/_config.py``; where it applies is the field's
metadata (``refused``, ``note``) and ``PER_CALL``. The page ``reference/options.md`` holds the marker
``<!-- modes -->``, replaced here by the table of options and ways of calling, and ``<!-- options -->``, by a
section per option.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Any


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs' hook: fill the markers of the options reference."""
    if page.file.src_uri != "reference/options.md":
        return markdown
    return markdown.replace("<!-- modes -->", modes_table()).replace("<!-- options -->", options_markdown())


def option_texts() -> dict[str, str]:
    """Each field's attribute docstring, by name, as written under the field in ``ParallelConfig``."""
    from mplaunch import _config

    tree = ast.parse(inspect.getsource(_config.ParallelConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    texts = {}
    for field, after in zip(body, body[1:], strict=False):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                texts[field.target.id] = inspect.cleandoc(after.value.value)
    return texts


def options_markdown() -> str:
    """A section per option: its type, its default and its text."""
    from mplaunch import _config

    texts = option_texts()
    fields = dataclasses.fields(_config.ParallelConfig)
    hints = _annotations(_config.ParallelConfig)
    sections = []
    for field in fields:
        text = _markdown(texts.get(field.name, ""))
        sections.append(f"### `{field.name}`\n\nType `{hints[field.name]}`, default `{field.default!r}`.\n\n{text}\n")
    return "\n".join(sections)


def modes_table() -> str:
    """The table of options (rows) and ways of calling (columns), and why each refusal is one."""
    from mplaunch import _config

    header = "| option | " + " | ".join(f"{mode}" for mode in _config.MODES) + " |"
    rows = [header, "|---" * (len(_config.MODES) + 1) + "|"]
    refusals = []
    for field in dataclasses.fields(_config.ParallelConfig):
        cells = []
        for mode in _config.MODES:
            reason = field.metadata["refused"].get(mode)
            note = field.metadata["note"].get(mode)
            if mode == "Workers.run/submit" and field.name not in _config.PER_CALL:
                reason = reason or "the Workers' own value applies: refused when the function's differs"
            if reason is not None:
                refusals.append(f"- `{field.name}`, {mode}: {reason}.")
                cells.append("no")
            else:
                cells.append(f"yes ({note})" if note else "yes")
        rows.append(f"| `{field.name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows) + '\n\nWhy each "no" is refused:\n\n' + "\n".join(refusals) + "\n"


def _annotations(cls: type) -> dict[str, str]:
    """Each field's annotation as written (the module uses postponed evaluation: they are strings)."""
    return {name: str(hint) for name, hint in cls.__annotations__.items()}


def _markdown(docstring: str) -> str:
    """A docstring's reStructuredText literals (````x````) as Markdown code (```x```)."""
    return re.sub(r"``(.+?)``", r"`\1`", textwrap.dedent(docstring), flags=re.S)
