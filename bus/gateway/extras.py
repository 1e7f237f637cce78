"""Imports of the parts that need an extra (``pip install 'idembus[web]'``), failing with
the command that installs what is missing."""

from __future__ import annotations

import importlib
from typing import Any

#: What the ``web`` extra brings that the HTTP parts (gateway, dashboard) import.
WEB = ("starlette", "uvicorn", "anyio", "h11")


def web_part(module: str, attribute: str, what: str) -> Any:
    """``attribute`` of ``module`` (an HTTP part); an ImportError naming ``what`` and
    ``pip install 'idembus[web]'`` if the web extra is missing."""
    try:
        return getattr(importlib.import_module(module), attribute)
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if missing not in WEB:
            raise
        raise ImportError(f"{what} needs {missing}: pip install 'idembus[web]'",
                          name=missing) from error
