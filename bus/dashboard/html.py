"""HTML built so that nothing from outside can become markup: every string is escaped
unless it is :class:`Markup` — HTML this package wrote itself.

Ids, bodies, headers, exception messages and states come from the queue and the storage,
and anybody who can send a message chooses them. They only ever reach a page through
:func:`escape` (by :func:`tag`, which escapes children and attribute values alike), so a
body holding ``<script>`` shows those characters and runs nothing. It is the autoescaping
of a template engine without the engine: a page is Python calls, and a forgotten escape
cannot happen, because a plain ``str`` is never trusted.
"""

from __future__ import annotations

import html
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Union

Child = Union["Markup", str, int, float, None, Iterable["Child"]]


class Markup(str):
    """A string that is HTML already (written by this package, or escaped)."""

    __slots__ = ()


def escape(value: object) -> Markup:
    """``value`` as text in HTML (quotes escaped too: safe in attribute values)."""
    if isinstance(value, Markup):
        return value
    return Markup(html.escape(str(value), quote=True))


def render(children: Child) -> Markup:
    """Children as HTML: strings and numbers escaped, Markup kept, ``None`` left out,
    iterables flattened."""
    if children is None:
        return Markup("")
    if isinstance(children, str | int | float):
        return escape(children)
    return Markup("".join(render(child) for child in children))


#: Elements without content or end tag.
_VOID = frozenset({"br", "hr", "img", "input", "link", "meta"})


def tag(name: str, /, *children: Child, **attributes: object) -> Markup:
    """``<name attributes>children</name>``. An attribute named with a trailing ``_``
    (``class_``) loses it, ``_`` inside a name becomes ``-`` (``data_refresh``); ``None``
    and ``False`` leave it out, ``True`` writes it bare."""
    parts = [name]
    for key, value in attributes.items():
        if value is None or value is False:
            continue
        attribute = key.rstrip("_").replace("_", "-")
        parts.append(attribute if value is True else f'{attribute}="{escape(value)}"')
    opening = f"<{' '.join(parts)}>"
    if name in _VOID:
        return Markup(opening)
    return Markup(f"{opening}{render(children)}</{name}>")


def url(path: str, query: Mapping[str, object] | Iterable[tuple[str, object]] = ()) -> str:
    """``path`` (this package's own) with a query string of ``query`` (``None`` values left
    out), every value percent-encoded."""
    pairs = query.items() if isinstance(query, Mapping) else query
    kept = [(key, str(value)) for key, value in pairs if value is not None]
    return f"{path}?{urllib.parse.urlencode(kept)}" if kept else path
