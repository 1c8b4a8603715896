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

    header = "| option | " + " | ".join(mode.replace("/", "/<wbr>") for mode in _config.MODES) + " |"
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
                cells.append(f"yes: {note}" if note else "yes")
        rows.append(f"| `{field.name}` | " + " | ".join(cells) + " |")
    table = '<div class="modes-table" markdown>\n\n' + "\n".join(rows) + "\n\n</div>"  # (docs/extra.css)
    return table + '\n\nWhy each "no" is refused:\n\n' + "\n".join(refusals) + "\n"


def _annotations(cls: type) -> dict[str, str]:
    """Each field's annotation as written (the module uses postponed evaluation: they are strings)."""
    return {name: str(hint) for name, hint in cls.__annotations__.items()}


def _markdown(docstring: str) -> str:
    """A docstring's reStructuredText literals (````x````) as Markdown code (```x```)."""
    return re.sub(r"``(.+?)``", r"`\1`", textwrap.dedent(docstring), flags=re.S)


# The design page's diagram, drawn as an inline SVG when the site is built (no script, no network) -----------

#: One call, top to bottom: each row is one box, or two side by side (the branches of a decision).
CALL_FLOW: list[list[tuple[str, str]]] = [
    [("fn(*args)", "_api: a CallRequest, checked once in the caller's thread")],
    [("the plan", "_parent/launch: devices, nprocs, start method, state, payload, LaunchSpec")],
    [
        ("one node: attempts", "_parent/restarts: a store, outcome files, a pump and a Ranks per attempt"),
        ("nnodes > 1", "_parent/nodes: torch elastic starts the ranks, c10d rendezvous"),
    ],
    [
        ("the ranks", "_worker/entry: set up, state restored, process group, the function, one outcome"),
        ("the ranks", "_worker/elastic: the same set-up and outcome; rank 0's value shared"),
    ],
    [
        (
            "the wait",
            "Ranks.call, one loop: ends, messages, stop, store, notice, deadline, board "
            "(several nodes: elastic's agent)",
        )
    ],
    [("the result", "rank 0's value (or every rank's), or the first failure raised as itself")],
]


def on_page_content(html: str, page: Any, **_: Any) -> str:
    """MkDocs' hook: draw the design page's diagram where its marker is."""
    if page.file.src_uri != "design.md":
        return html
    return html.replace("<!-- diagram: call -->", flow_svg(CALL_FLOW))


def flow_svg(rows: list[list[tuple[str, str]]]) -> str:
    """A top-to-bottom flow of boxes (a title and a line of text each), arrows from each row to the next."""
    width, box_h, gap, pad = 720, 64, 26, 10
    height = len(rows) * (box_h + gap) - gap + 2 * pad
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" '
        'aria-label="How one call flows through the code" style="max-width:100%;height:auto;'
        'font-family:sans-serif">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    centres: list[list[float]] = []
    for index, row in enumerate(rows):
        y = pad + index * (box_h + gap)
        column = (width - 2 * pad - (len(row) - 1) * gap) / len(row)
        centres.append([])
        for slot, (title, text) in enumerate(row):
            x = pad + slot * (column + gap)
            centres[-1].append(x + column / 2)
            parts.append(
                f'<rect x="{x:.0f}" y="{y}" width="{column:.0f}" height="{box_h}" rx="6" '
                'fill="#eef3fb" stroke="#4a6fa5"/>'
            )
            parts.append(
                f'<text x="{x + column / 2:.0f}" y="{y + 22}" text-anchor="middle" font-size="14" '
                f'font-weight="bold" fill="#1b2a41">{_escape(title)}</text>'
            )
            for number, line in enumerate(textwrap.wrap(text, int(column / 6.2))[:2]):
                parts.append(
                    f'<text x="{x + column / 2:.0f}" y="{y + 40 + 14 * number}" text-anchor="middle" '
                    f'font-size="11.5" fill="#333">{_escape(line)}</text>'
                )
        if index:
            top, bottom = centres[-2], centres[-1]
            links = (
                list(zip(top, bottom, strict=True))
                if len(top) == len(bottom)
                else [(a, b) for a in top for b in bottom]
            )
            y0, y1 = y - gap, y
            for a, b in links:
                parts.append(
                    f'<line x1="{a:.0f}" y1="{y0}" x2="{b:.0f}" y2="{y1 - 2}" stroke="#555" marker-end="url(#arrow)"/>'
                )
    parts.append("</svg>")
    return "".join(parts)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
