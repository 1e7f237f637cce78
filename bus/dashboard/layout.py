"""The frame every page shares: the document, its navigation, and small pieces (times,
definition lists, notices) the pages have in common."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..envelope import format_utc, parse_utc
from .html import Child, Markup, escape, render, tag, url

#: The pages of the navigation: (path, title).
PAGES = (("/", "Overview"), ("/errors", "Failed messages"), ("/aggregates", "Sagas and aggregates"),
         ("/journal", "Live stream"))


def document(title: str, body: Child, *, active: str, endpoints: Sequence[str],
             endpoint: str | None = None) -> Markup:
    """A whole page: ``body`` under the navigation, with the shipped stylesheet and
    script (nothing inline)."""
    links = [tag("a", name, href=url(path, {"endpoint": endpoint}),
                 class_="active" if path == active else None) for path, name in PAGES]
    choose = None
    if endpoint is not None and len(endpoints) > 1:
        choose = tag("form", tag("label", "endpoint ", tag("select", [
            tag("option", name, value=name, selected=name == endpoint) for name in endpoints],
            name="endpoint", data_autosubmit="1")), method="get", action=active,
            class_="choose")
    return Markup("<!DOCTYPE html>" + tag(
        "html",
        tag("head", tag("meta", charset="utf-8"),
            tag("meta", name="viewport", content="width=device-width, initial-scale=1"),
            tag("title", f"{title} · idembus"),
            tag("link", rel="stylesheet", href="/static/dashboard.css"),
            tag("link", rel="icon", href="/static/favicon.svg", type="image/svg+xml"),
            tag("script", src="/static/dashboard.js", defer=True)),
        tag("body",
            tag("header", tag("span", "idembus", class_="brand"), tag("nav", links), choose),
            tag("main", tag("h1", title), body)),
        lang="en"))


def moment(value: datetime.datetime | str | None) -> Markup:
    """A time as UTC text in a ``<time>`` element (``-`` if unknown)."""
    if value is None or value == "":
        return escape("-")
    if isinstance(value, str):
        parsed = parse_utc(value)
        if parsed is None:
            return tag("time", value)  # unreadable: shown as it came
        value = parsed
    text = format_utc(value)
    return tag("time", text.replace("T", " ")[:19] + " UTC", datetime=text)


def pairs(rows: Iterable[tuple[Child, Child]], **attributes: object) -> Markup:
    """A two-column table of name, value rows."""
    attributes.setdefault("class_", "pairs")
    return tag("table", tag("tbody", [tag("tr", tag("th", name, scope="row"), tag("td", value))
                                      for name, value in rows]), **attributes)


def notice(text: Child, kind: str = "info") -> Markup:
    return tag("p", text, class_=f"notice {kind}", role="status")


def pretty(value: Any) -> Markup:
    """JSON (or text) in a ``<pre>``, indented."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return tag("pre", value, class_="code")
    return tag("pre", json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True,
                                 default=str), class_="code")


def table(head: Sequence[Child], rows: Iterable[Sequence[Child]], *,
          empty: str = "nothing", foot: Child = None, **attributes: object) -> Markup:
    """A table with a header row; one row saying ``empty`` when there are none; ``foot``:
    the rows of its ``<tfoot>`` (a total), if any."""
    body = [tag("tr", [tag("td", cell) for cell in row]) for row in rows]
    if not body:
        body = [tag("tr", tag("td", empty, colspan=len(head), class_="empty"))]
    return tag("table", tag("thead", tag("tr", [tag("th", cell, scope="col") for cell in head])),
               tag("tbody", body), tag("tfoot", foot) if foot is not None else None,
               **attributes)


def hidden(fields: Mapping[str, object] | Iterable[tuple[str, object]]) -> Markup:
    """Hidden inputs carrying ``fields`` (``None`` values left out)."""
    items = fields.items() if isinstance(fields, Mapping) else fields
    return render([tag("input", type="hidden", name=name, value=value)
                   for name, value in items if value is not None])
