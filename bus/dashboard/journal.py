"""The live stream: the endpoint's event journal as it grows, with the gateway's ``types``
and ``parents`` filters.

The page shows the newest entries that pass the filters, read from the storage, and the
shipped script follows the gateway's own stream (mounted under ``/stream/N/``) from the
last of them on, with ``last_event_id`` (from an empty journal: the time it was read):
nothing between the two is lost or repeated. Each
event is written into the page as text (``textContent``), never as markup.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..envelope import utc_now
from ..errors import BadStreamRequest
from ..gateway.request import TIMESTAMP_FROM, Filters, filters_from
from ..storage.base import JournalEntry, JournalStore
from .html import Markup, render, tag, url
from .layout import hidden, moment, notice, table
from .pages import Page, Refused

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint
    from .failed import Params

#: Entries of the journal read for the page at most (the newest), before filtering.
RECENT = 500
#: Rows the page keeps (older ones are dropped by the script as new ones come).
ROWS = 200


def journal(endpoint: Endpoint, params: Params, stream: str | None) -> Page:
    """The page of ``endpoint``'s journal; ``stream``: where its gateway stream is mounted
    (``None``: the endpoint keeps no journal)."""
    types = (params.get("types") or "").strip()
    parents = (params.get("parents") or "").strip()
    form = tag(
        "form", hidden({"endpoint": endpoint.name}),
        tag("label", "types ", tag("input", name="types", value=types, size=30,
                                   placeholder="OrderPlaced,Order")),
        tag("label", "parents ", tag("input", name="parents", value=parents, size=30,
                                     placeholder="user/42,Order/o-17")),
        tag("button", "Filter", type="submit"),
        tag("a", "clear", href=url("/journal", {"endpoint": endpoint.name})),
        method="get", action="/journal", class_="filters")
    if stream is None:
        return Page("Live stream", render([notice(
            f"{endpoint.name} keeps no event journal: Endpoint(journal=True) journals the "
            "events it publishes.", "warn")]))
    query = {"types": types or None, "parents": parents or None}
    try:
        filters = filters_from({key: [value] for key, value in query.items() if value})
    except BadStreamRequest as error:
        raise Refused(str(error)) from None
    read_at = utc_now()
    journal = endpoint.storage_as(JournalStore)
    bounds = journal.journal_bounds()
    entries = journal.read_journal(after=max(0, bounds.newest - RECENT), limit=RECENT)
    shown = [entry for entry in entries if filters.matches(entry)][-ROWS:]
    # Resume after the newest entry read; from an empty journal, from the time it was read
    # (a position of 0 would ask for full replication)
    resume = bounds.newest or max(TIMESTAMP_FROM, int(read_at.timestamp() * 1000))
    source = url(stream, {**query, "last_event_id": resume})
    rows = [_row(entry) for entry in reversed(shown)]
    return Page("Live stream", render([
        form,
        tag("p", tag("span", "connecting…", id="stream-state", class_="badge"), " ",
            f"journal positions {bounds.oldest or 0}–{bounds.newest}, {bounds.size} kept; "
            f"newest first, {ROWS} rows at most", class_="caption"),
        table(["position", "recorded", "type", "aggregate", "parents", "body"], rows,
              empty="nothing yet", id="journal", data_stream=source, data_rows=ROWS,
              class_="journal"),
        _filter_note(filters)]))


def _row(entry: JournalEntry) -> list[Markup | str]:
    aggregate = (f"{entry.aggregate_type}/{entry.aggregate_id}"
                 if entry.aggregate_type and entry.aggregate_id else "-")
    return [str(entry.position), moment(entry.recorded_at), tag("code", entry.message_type),
            tag("code", aggregate), tag("code", ", ".join(entry.parents) or "-"),
            tag("code", _compact(entry.body), class_="body")]


def _compact(body: str) -> str:
    try:
        return json.dumps(json.loads(body), separators=(",", ":"), ensure_ascii=False)
    except ValueError:
        return body


def _filter_note(filters: Filters) -> Markup | None:
    if filters.types is None and filters.parents is None:
        return None
    said = [f"{name}={','.join(sorted(values))}" for name, values in
            (("types", filters.types), ("parents", filters.parents)) if values is not None]
    return tag("p", "The stream's filter: ", tag("code", "&".join(said)),
               class_="caption")
