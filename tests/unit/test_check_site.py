"""scripts/check_site.py finds what renders wrong on a built page, and passes a page that renders right."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from tests.helpers import REPO


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_site", REPO / "scripts" / "check_site.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(*cells: str) -> str:
    return '<tr class="doc-section-item">' + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>"


def _section(title: str, *rows: str) -> str:
    return f'<p><span class="doc-section-title">{title}:</span></p>\n<table><tbody>{"".join(rows)}</tbody></table>'


def _page(tmp_path: Path, body: str) -> list[str]:
    """The problems check_site finds on an API page whose article is ``body``."""
    page = tmp_path / "reference" / "api" / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f'<article class="md-content__inner">{body}</article>')
    return list(_checker().check_page(tmp_path, page))


# mplaunch.spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn", **options)
SPAWN = '<h2 id="mplaunch.spawn" class="doc doc-heading">spawn</h2>'


def test_a_page_that_renders_right_passes(tmp_path: Path) -> None:
    good = SPAWN + _section(
        "Parameters",
        _row("<code>fn</code>", "<code>Callable</code>", "the function", "<em>required</em>"),
        _row("<code>nprocs</code>", "<code>int</code>", "how many", "<code>1</code>"),
    )
    good += _section("Returns", _row("<code>Any</code>", "Rank 0's value<br>over two lines"))
    problems = _page(tmp_path, good + "<p>See [<code>parallel()</code>](#mplaunch.parallel).</p>")
    assert problems == ["reference/api/index.html: 1 documented objects found: does this script still read the HTML?"]


def test_each_rendering_fault_is_named(tmp_path: Path) -> None:
    bad = SPAWN + _section(
        "Parameters",
        _row("<code>nprocs</code>", "<code>int</code>", "how many", "<em>required</em>"),  # has a default
        _row("<code>join</code>", "", "wait", "<code>True</code>"),  # annotated, no Type
        _row("<code>timeout</code>", "", "seconds", "<em>required</em>"),  # an option, not a parameter
    )
    bad += _section("Returns", _row("<code>A</code>", "<code>Any</code>", "class:"), _row("", "", "a line"))
    bad += _section("Attributes", _row("<code>rank</code>", "", "the rank"))
    bad += "<p>Read it with :func:<code>mplaunch.worker_info</code>.</p><blockquote><blockquote>&gt;&gt;&gt;"
    text = "\n".join(_page(tmp_path, bad))
    assert "role as text: ':func:'" in text
    assert "'nprocs' shows as required but defaults to 1" in text
    assert "'join' is annotated but its Type is empty" in text
    assert "documents a parameter 'timeout' that the signature does not have" in text
    assert "one value's Returns split into 2 rows" in text
    assert "attribute 'rank' has an empty Type" in text
    assert "nested block quotes" in text
