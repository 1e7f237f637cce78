"""The documentation site builds with ``mkdocs build --strict``: a broken link, a page
missing from the navigation or a public name the API reference cannot find fails here."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# make test installs the docs extra; elsewhere: pip install -e '.[docs]'
for _module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
    pytest.importorskip(_module, reason="needs the docs extra: pip install -e '.[docs]'")


def test_the_site_builds_strictly(tmp_path: pathlib.Path):
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    assert (site / "index.html").is_file()
    assert (site / "reference" / "idembus" / "index.html").is_file()
    # The changelog page is CHANGELOG.md itself, included at build time.
    changelog = (site / "changelog" / "index.html").read_text()
    assert "Keep a Changelog" in changelog


def test_every_page_is_in_the_navigation():
    # mkdocs only warns about pages left out of nav in strict mode when it is told to;
    # this says which.
    import yaml

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    listed: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, str):
            listed.add(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(config["nav"])
    pages = {str(page.relative_to(ROOT / "docs")) for page in (ROOT / "docs").rglob("*.md")}
    assert pages - listed == set()
    assert listed - pages == set()
