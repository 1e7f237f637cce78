"""The sagas (or aggregates) of one type, a page at a time: the live ones or the completed
ones (their tombstones, with the state each ended with), in the order of their ids,
filtered on the start of the id; each links to its story."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..storage.base import AggregateStore
from .html import Markup, render, tag, url
from .layout import moment, table
from .pages import Page, Refused

if TYPE_CHECKING:
    from .failed import Params

#: Sagas shown per page.
PAGE = 50
#: Characters of a state shown in the list (the story shows all of it).
STATE_CHARACTERS = 160
#: Longest id prefix or ``after`` id accepted.
LONGEST = 512


def saga_list(endpoint: str, storage: AggregateStore, aggregate_type: str, params: Params,
              lookup: Markup) -> Page:
    """The page of ``aggregate_type``'s sagas that ``params`` asks for (``status``:
    ``live`` or ``completed``; ``prefix``: the start of their ids; ``after``: the last id
    of the page before), under the ``lookup`` form."""
    status = params.get("status") or "live"
    if status not in ("live", "completed"):
        raise Refused(f"status is live or completed, not {status[:40]!r}")
    prefix = (params.get("prefix") or "").strip()
    after = params.get("after") or None
    if len(prefix) > LONGEST or len(after or "") > LONGEST:
        raise Refused(f"an id longer than {LONGEST} characters is no aggregate's")
    completed = status == "completed"
    page = storage.aggregate_page(aggregate_type, completed=completed, after=after, limit=PAGE,
                                  id_prefix=prefix)
    here = {"endpoint": endpoint, "type": aggregate_type, "status": status,
            "prefix": prefix or None}
    filters = tag(
        "form", render([tag("input", type="hidden", name=name, value=value)
                        for name, value in (("endpoint", endpoint), ("type", aggregate_type))]),
        tag("label", "show ", tag("select", [
            tag("option", label, value=value, selected=value == status)
            for value, label in (("live", "live"), ("completed", "completed (tombstones)"))],
            name="status")),
        tag("label", "id starts with ", tag("input", name="prefix", value=prefix, size=24)),
        tag("button", "List", type="submit"),
        method="get", action="/aggregates", class_="filters saga-filters")
    rows = [[tag("a", tag("code", record.aggregate_id), href=url("/aggregates", {
                 "endpoint": endpoint, "type": aggregate_type, "id": record.aggregate_id})),
             str(record.version), moment(record.updated_at),
             tag("code", _short(record.final_state if completed else record.state))]
            for record in page]
    listed = table(["id", "version", "completed" if completed else "updated",
                    "last state" if completed else "state"], rows,
                   empty=f"no {status} {aggregate_type}"
                         + (f" with an id starting {prefix!r}" if prefix else ""),
                   class_="sagas")
    paging = [tag("a", "First page", href=url("/aggregates", here)) if after else None,
              tag("a", "Next page", href=url("/aggregates", {**here, "after": page[-1].
                                                             aggregate_id}), rel="next")
              if len(page) == PAGE else None]
    shown = "after " + repr(after) if after else "from the first"
    caption = tag("p", f"{len(page)} {status} {aggregate_type} shown, by id, {shown}",
                  " (a completed saga stays until the storage's retention removes it)"
                  if completed else "", class_="caption")
    return Page(f"{aggregate_type}: {status} sagas", render([
        lookup, filters, caption, listed,
        tag("p", [render([link, " "]) for link in paging if link is not None],
            class_="paging")]))


def _short(state: Mapping[str, Any] | None) -> str:
    """A state on one line, cut to :data:`STATE_CHARACTERS`."""
    if state is None:
        return "-"
    text = json.dumps(state, ensure_ascii=False, sort_keys=True, default=str)
    return text if len(text) <= STATE_CHARACTERS else text[:STATE_CHARACTERS - 1] + "…"
