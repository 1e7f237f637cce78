"""Every ```python block of README.md and docs/ runs, so the documentation cannot drift.

One test per page, so a failure names its page. A block runs in a fresh namespace unless
an HTML comment on the line before it says otherwise:

``<!-- fragment -->``
    compiled only (it needs a broker, a database, a Spark session, or names it leaves to
    the reader);
``<!-- continues -->``
    runs in the namespace of the page's blocks before it (which ran in order);
``<!-- continues: other.md -->``
    runs in the namespace left by every block of ``other.md`` (a path relative to the
    page), then goes on with the page's own.

Endpoints a page leaves in its namespaces are closed after it.
"""

from __future__ import annotations

import gc
import pathlib
import re
import sys
import types
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_BLOCK = re.compile(r"(?:<!--\s*(?P<marker>[^>]*?)\s*-->\s*\n)?```python\n(?P<code>.*?)```",
                    flags=re.S)


@dataclass(frozen=True)
class Block:
    """One ```python block: its code, its first line and the marker before it."""

    code: str
    line: int
    marker: str


def pages() -> list[pathlib.Path]:
    """README.md and every page of the site that has a ```python block."""
    found = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [page for page in found if "```python" in page.read_text()]


def blocks(page: pathlib.Path) -> list[Block]:
    """The page's ```python blocks, in order."""
    text = page.read_text()
    return [Block(match.group("code"), text.count("\n", 0, match.start("code")) + 1,
                  (match.group("marker") or "").strip())
            for match in _BLOCK.finditer(text)]


class PageRun:
    """Runs the blocks of pages, keeping each page's namespace for the pages that continue
    it, and the endpoints they made, to close them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.namespaces: dict[pathlib.Path, dict[str, object]] = {}
        self.made: list[dict[str, object]] = []

    def run(self, page: pathlib.Path) -> dict[str, object]:
        """Run ``page``'s blocks; return the namespace its last block left."""
        page = page.resolve()
        if page in self.namespaces:
            return self.namespaces[page]
        current: dict[str, object] | None = None
        for block in blocks(page):
            source = "\n" * (block.line - 1) + block.code
            code = compile(source, str(page), "exec")
            if block.marker == "fragment":
                continue
            if block.marker.startswith("continues:"):
                other = (page.parent / block.marker.split(":", 1)[1].strip()).resolve()
                current = self._fresh(page, dict(self.run(other)))
            elif block.marker == "continues":
                assert current is not None, f"{page}:{block.line}: nothing to continue"
            else:
                assert block.marker == "", f"{page}:{block.line}: unknown marker {block.marker!r}"
                current = self._fresh(page, {})
            exec(code, current)
        self.namespaces[page] = current or {}
        return self.namespaces[page]

    def _fresh(self, page: pathlib.Path, seed: dict[str, object]) -> dict[str, object]:
        """A namespace of a module of its own (pydantic resolves annotations through it)."""
        name = f"docs_snippet_{len(self.made)}"
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in seed.items() if k not in ("__name__",)})
        module.__dict__["__name__"] = name
        module.__dict__["__file__"] = str(page)
        self.monkeypatch.setitem(sys.modules, name, module)
        self.made.append(module.__dict__)
        return module.__dict__

    def close(self) -> None:
        """Close every endpoint the pages left in their namespaces, then let go of the
        message classes they defined: ``idembus.testing`` decodes what a handler sent by
        the classes of its name that exist, and the next page defines its own."""
        from idembus import Endpoint

        closed: set[int] = set()
        for namespace in self.made:
            for value in list(namespace.values()):
                if isinstance(value, Endpoint) and id(value) not in closed:
                    closed.add(id(value))
                    value.close()
        for namespace in self.made:
            namespace.clear()
        self.made.clear()
        self.namespaces.clear()
        gc.collect()


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", pages(), ids=_page_id)
def test_python_blocks_of_the_page_run(page: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    # The tutorial's pages import its sample, a package of its own (samples/shop), as a
    # reader who installed it would.
    monkeypatch.syspath_prepend(str(ROOT / "samples" / "shop"))
    run = PageRun(monkeypatch)
    try:
        run.run(page)
    finally:
        run.close()


def test_markers_name_what_the_runner_knows():
    # A mistyped marker would silently run a block in a fresh namespace, or not at all.
    for page in pages():
        for block in blocks(page):
            assert (block.marker in ("", "fragment", "continues")
                    or block.marker.startswith("continues:")), f"{page}:{block.line}"


def test_every_page_with_code_is_collected():
    # README and the quick start are the pages a newcomer runs first.
    collected = {_page_id(page) for page in pages()}
    assert {"README.md", "docs/quickstart.md"} <= collected
