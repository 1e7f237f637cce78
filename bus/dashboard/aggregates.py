"""Sagas and aggregates: one looked up by type and id — its state, version and updated
time, and the messages it processed with the ids of what each sent and whether that was
dispatched. A completed saga shows its tombstone: no state, its entries kept."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..storage.base import AggregateStore
from .html import Markup, render, tag
from .layout import hidden, moment, notice, pairs, pretty, table
from .lookup import look_up
from .pages import Page, Refused

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint
    from .failed import Params

#: Longest type or id accepted (a lookup, not a scan).
LONGEST = 512


def aggregates(endpoint: Endpoint, params: Params, known: Sequence[str]) -> Page:
    """The lookup form and, given a type and an id, what the storage holds."""
    aggregate_type = (params.get("type") or "").strip()
    aggregate_id = (params.get("id") or "").strip()
    form = tag(
        "form", hidden({"endpoint": endpoint.name}),
        tag("label", "type ", tag("input", name="type", value=aggregate_type, required=True,
                                  list="aggregate-types", size=28)),
        tag("datalist", [tag("option", value=name) for name in known], id="aggregate-types"),
        tag("label", "id ", tag("input", name="id", value=aggregate_id, required=True, size=36)),
        tag("button", "Look up", type="submit"),
        method="get", action="/aggregates", class_="filters")
    if not aggregate_type and not aggregate_id:
        hint = tag("p", "The aggregate types of ", tag("code", endpoint.name), ": ",
                   render([tag("code", name) for name in known]) if known else "none",
                   " (a saga is stored under its handler's type).", class_="caption")
        return Page("Sagas and aggregates", render([form, hint]))
    if not aggregate_type or not aggregate_id:
        raise Refused("give both the aggregate type and its id")
    if len(aggregate_type) > LONGEST or len(aggregate_id) > LONGEST:
        raise Refused(f"a type or id longer than {LONGEST} characters is no aggregate's")
    found = look_up(endpoint.storage_as(AggregateStore), aggregate_type, aggregate_id)
    record = found.record
    if not record.exists:
        return Page("Sagas and aggregates", render([
            form, notice(f"No {aggregate_type} {aggregate_id!r} is stored.", "warn")]), 404)
    state: Markup
    if record.completed:
        state = render([notice("Completed: this saga ended and left a tombstone. Its state "
                               "is gone; the messages it processed are kept, so a late "
                               "duplicate is still recognised (and its stored messages sent "
                               "again with their ids).", "tombstone"),
                        tag("p", "State: none (tombstone)", class_="caption")])
    else:
        state = pretty(record.state)
    summary = pairs([
        ("type", tag("code", record.aggregate_type)), ("id", tag("code", record.aggregate_id)),
        ("status", "completed (tombstone)" if record.completed else "live"),
        ("version", str(record.version)),
        ("state version", str(record.state_version or 1)),
        ("updated", moment(record.updated_at)),
    ], class_="pairs aggregate")
    entries = table(
        ["message id (handler-scoped)", "committed", "outgoing message ids", "dispatched"],
        [[tag("code", entry.key), moment(entry.at),
          render([tag("div", tag("code", outgoing)) for outgoing in entry.outgoing_ids])
          or "none",
          tag("span", "yes" if entry.dispatched else "not yet",
              class_="state running" if entry.dispatched else "state stale")]
         for entry in found.entries],
        empty="no processed message remembered", class_="entries")
    return Page(f"{record.aggregate_type} {record.aggregate_id}", render([
        form, summary, tag("h2", "State"), state,
        tag("h2", "Processed messages", tag("span", " (newest first)", class_="caption")),
        entries,
        notice(f"showing the newest {len(found.entries)}") if found.more else None]))
