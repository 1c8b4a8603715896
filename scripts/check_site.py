"""Check the built documentation for what renders wrong though ``mkdocs build --strict`` passes.

Usage: ``python scripts/check_site.py SITE_DIR`` (``make check`` runs it on the site it builds). It exits 1 and
lists each problem, by page and object, when a page shows:

- a reStructuredText role or directive as text (``:func:`x```, ``.. note::``): mkdocstrings renders Markdown, and
  a cross-reference is written ``[`x`][mplaunch.x]``;
- a parameter documented as "required" that has a default, an empty Type for a parameter that is annotated, or a
  documented parameter that the signature does not have (the truth is the imported object's ``inspect.signature``);
- an attribute with an empty Type;
- one return value split into several rows of a Returns table (a continuation line read as a new item);
- nested block quotes, which is how a ``>>>`` example renders outside an Examples section.
"""

from __future__ import annotations

import html
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROLE = re.compile(r"(?<![\w:]):(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const|ref|doc|term|any):(?=\S)")
DIRECTIVE = re.compile(r"(?m)^\s*\.\. [a-z-]+::")
HEADING = re.compile(r'<h\d id="(mplaunch[\w.]*)" class="doc doc-heading"')
SECTION = re.compile(r'doc-section-title">(\w+):</span></p>\s*<table>(.*?)</table>', re.S)
ROW = re.compile(r'<tr class="doc-section-item">(.*?)</tr>', re.S)
CELL = re.compile(r"<td>(.*?)</td>", re.S)


def text_of(fragment: str) -> str:
    """Visible text of an HTML fragment."""
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


def prose_of(fragment: str) -> str:
    """Visible text outside code: code blocks dropped, inline code replaced by ``CODE``."""
    fragment = re.sub(r"<pre.*?</pre>", " ", fragment, flags=re.S)
    return text_of(re.sub(r"<code.*?</code>", "CODE", fragment, flags=re.S))


def resolve(path: str) -> Any:
    """The object a heading id names (``mplaunch.Workers.run``), or ``None``."""
    module, *names = path.split(".")
    found: Any = importlib.import_module(module)
    for name in names:
        found = inspect.getattr_static(found, name, None)
        if isinstance(found, (staticmethod, classmethod)):
            found = found.__func__
        if found is None:
            return None
    return found


def check_parameters(where: str, target: Any, rows: list[list[str]]) -> list[str]:
    """Compare a Parameters table (name, type, description, default) with the signature of ``target``."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    problems = []
    for name_cell, type_cell, _, default_cell in (row for row in rows if len(row) == 4):
        name = text_of(name_cell).strip().lstrip("*")
        parameter = parameters.get(name)
        if parameter is None:
            problems.append(f"{where}: documents a parameter {name!r} that the signature does not have")
            continue
        if parameter.default is not inspect.Parameter.empty and text_of(default_cell).strip() == "required":
            problems.append(f"{where}: {name!r} shows as required but defaults to {parameter.default!r}")
        if parameter.annotation is not inspect.Parameter.empty and not text_of(type_cell).strip():
            problems.append(f"{where}: {name!r} is annotated but its Type is empty")
    return problems


def check_attributes(where: str, rows: list[list[str]]) -> list[str]:
    """Flag an attribute of an Attributes table (name, type, description) whose Type is empty: annotate it."""
    return [
        f"{where}: attribute {text_of(row[0]).strip()!r} has an empty Type (annotate it in the class body)"
        for row in rows
        if len(row) == 3 and not text_of(row[1]).strip()
    ]


def check_object(page: str, path: str, chunk: str) -> list[str]:
    """The tables of one documented object (the part of the page up to the next object's heading)."""
    where = f"{page} {path}"
    target = resolve(path)
    problems = []
    for title, table in SECTION.findall(chunk):
        rows = [CELL.findall(row) for row in ROW.findall(table)]
        if title == "Parameters" and target is not None:
            problems += check_parameters(where, target, rows)
        elif title == "Attributes":
            problems += check_attributes(where, rows)
        elif title in ("Returns", "Yields") and len(rows) > 1:
            problems.append(f"{where}: one value's {title} split into {len(rows)} rows (a name column or a line break)")
    return problems


def check_page(site: Path, page: Path) -> list[str]:
    """Every problem of one built page."""
    name = str(page.relative_to(site))
    content = page.read_text(encoding="utf-8")
    content = content[content.find('<article class="md-content__inner') : content.find("</article>")]
    visible = prose_of(content)
    problems = [f"{name}: reStructuredText role as text: {match!r}" for match in ROLE.findall(visible)]
    problems += [f"{name}: reStructuredText directive as text: {d.strip()!r}" for d in DIRECTIVE.findall(visible)]
    if re.search(r"<blockquote>\s*<blockquote>", content):
        problems.append(f"{name}: nested block quotes (a >>> example outside a code block)")
    headings = list(HEADING.finditer(content))
    for index, heading in enumerate(headings):
        end = headings[index + 1].start() if index + 1 < len(headings) else len(content)
        problems += check_object(name, heading.group(1), content[heading.end() : end])
    if name == "reference/api/index.html" and len(headings) < 10:  # the check must not pass by finding nothing
        problems.append(f"{name}: {len(headings)} documented objects found: does this script still read the HTML?")
    return problems


def main(argv: list[str]) -> int:
    """Check every page of the site built in ``argv[1]``; print the problems and return 1 if there are any."""
    if len(argv) != 2 or not Path(argv[1], "index.html").is_file():
        print("usage: python scripts/check_site.py SITE_DIR (a built site: mkdocs build --site-dir SITE_DIR)")
        return 2
    site = Path(argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's mplaunch, which the site documents
    problems = [problem for page in sorted(site.rglob("*.html")) for problem in check_page(site, page)]
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s) in {site}" if problems else f"the site in {site} renders cleanly")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
