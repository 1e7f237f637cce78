"""mkdocs hook: lay the repository's folders out as the ``idembus`` package it installs.

``setup.cfg`` maps ``bus/`` onto ``idembus`` and ``handlers/``, ``storage/`` and
``transports/`` onto its subpackages. mkdocstrings reads source files, not imports, so it
needs them in one tree: ``build/docs-src/idembus`` is made of symbolic links to them.
"""

from __future__ import annotations

import pathlib
from typing import Any

from mkdocs.plugins import event_priority

PACKAGE_DIRS = {"handlers": "handlers", "storage": "storage", "transports": "transports"}


@event_priority(100)  # before mkdocstrings collects the package (first build of a checkout)
def on_config(config: Any) -> Any:
    """Make ``build/docs-src/idembus`` before mkdocstrings looks for it."""
    root = pathlib.Path(config.config_file_path).resolve().parent
    package = root / "build" / "docs-src" / "idembus"
    package.mkdir(parents=True, exist_ok=True)
    wanted = {entry.name: entry for entry in (root / "bus").iterdir()
              if entry.name != "__pycache__"}
    wanted.update({name: root / folder for name, folder in PACKAGE_DIRS.items()})
    for existing in package.iterdir():
        if existing.name not in wanted or not existing.is_symlink():
            existing.unlink()
    for name, target in wanted.items():
        link = package / name
        if not link.is_symlink():
            link.symlink_to(target)
    return config
