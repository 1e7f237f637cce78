"""Sagas and aggregates: the live ones of a type listed a page at a time (or the completed
ones, with the state each ended with; :mod:`.saga_list`), and one looked up by type and id
— its story: its state (a completed saga: the state it ended with and the message that
ended it), version and updated time, and the messages it processed, with their types,
times, handlers, what each sent and whether that was dispatched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..storage.base import AggregateStore, ProcessedMessage
from .html import Markup, render, tag, url
from .layout import hidden, moment, notice, pairs, pretty, table
from .lookup import look_up
from .pages import Page, Refused
from .saga_list import saga_list

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint
    from .failed import Params

#: Longest type or id accepted (a lookup, not a scan).
LONGEST = 512
#: What the page says of a completed saga.
TOMBSTONE = ("Completed: this saga ended and left a tombstone. The messages it processed "
             "are kept, so a late duplicate is still recognised (and its stored messages "
             "sent again with their ids), and so is the state it ended with, until the "
             "storage's retention removes the tombstone.")


def aggregates(endpoint: Endpoint, params: Params, known: Sequence[str]) -> Page:
    """The lookup form; given a type, its live (or completed) ones; given a type and an
    id, that one's story."""
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
        links = [tag("a", tag("code", name), href=url("/aggregates", {
            "endpoint": endpoint.name, "type": name})) for name in known]
        hint = tag("p", "The aggregate types of ", tag("code", endpoint.name), ": ",
                   render([render([link, " "]) for link in links]) if known else "none",
                   " (a saga is stored under its handler's type; follow one to list its "
                   "live sagas).", class_="caption")
        return Page("Sagas and aggregates", render([form, hint]))
    if not aggregate_type:
        raise Refused("give the aggregate type (and its id to look one up)")
    if len(aggregate_type) > LONGEST or len(aggregate_id) > LONGEST:
        raise Refused(f"a type or id longer than {LONGEST} characters is no aggregate's")
    storage = endpoint.storage_as(AggregateStore)
    if not aggregate_id:
        return saga_list(endpoint.name, storage, aggregate_type, params, form)
    return _story(endpoint.name, storage, aggregate_type, aggregate_id, form)


def _story(endpoint: str, storage: AggregateStore, aggregate_type: str, aggregate_id: str,
           form: Markup) -> Page:
    found = look_up(storage, aggregate_type, aggregate_id)
    record = found.record
    if not record.exists:
        return Page("Sagas and aggregates", render([
            form, notice(f"No {aggregate_type} {aggregate_id!r} is stored (never started, or "
                         "completed longer ago than the storage's retention).", "warn")]), 404)
    ended = record.ended_by()
    state: Markup
    if record.completed:
        state = render([
            notice(TOMBSTONE, "tombstone"),
            tag("h2", "Last state"),
            pretty(record.final_state) if record.final_state is not None else tag(
                "p", "Not kept: the saga keeps no final state (keep_final_state = False), or "
                     "it ended before idembus kept one.", class_="caption")])
    else:
        state = render([tag("h2", "State"), pretty(record.state)])
    rows: list[tuple[Markup | str, Markup | str]] = [
        ("type", tag("code", record.aggregate_type)), ("id", tag("code", record.aggregate_id)),
        ("status", "completed (tombstone)" if record.completed else "live"),
        ("version", str(record.version)),
        ("state version", str(record.state_version or 1)),
        ("completed" if record.completed else "updated", moment(record.updated_at)),
    ]
    if record.completed:
        rows.append(("ended by", _ending(ended)))
    summary = pairs(rows, class_="pairs aggregate")
    entries = table(
        ["committed", "message type", "message id", "handler", "outcome",
         "outgoing message ids", "dispatched"],
        [_row(entry, entry is ended) for entry in found.entries],
        empty="no processed message remembered", class_="entries")
    back = tag("p", tag("a", f"all {'completed' if record.completed else 'live'} "
                             f"{record.aggregate_type}", href=url("/aggregates", {
                                 "endpoint": endpoint, "type": record.aggregate_type,
                                 "status": "completed" if record.completed else None})),
               class_="caption")
    return Page(f"{record.aggregate_type} {record.aggregate_id}", render([
        form, back, summary, state,
        tag("h2", "Processed messages", tag("span", " (newest first)", class_="caption")),
        entries,
        notice(f"showing the newest {len(found.entries)}") if found.more else None]))


def _ending(ended: ProcessedMessage | None) -> Markup:
    """The message that completed a saga, as its summary row shows it."""
    if ended is None:
        return render("not kept")
    _, message_id = _split(ended.key)
    return render([tag("code", ended.message_type or "(type not recorded)"), " ",
                   tag("code", message_id), " at ", moment(ended.at)])


def _row(entry: ProcessedMessage, ending: bool) -> list[Markup | str]:
    handler, message_id = _split(entry.key)
    return [
        moment(entry.at),
        tag("code", entry.message_type) if entry.message_type else tag(
            "span", "not recorded", class_="caption"),
        tag("code", message_id), tag("code", handler) if handler else "-",
        tag("strong", "completed the saga") if ending else "handled",
        render([tag("div", tag("code", outgoing)) for outgoing in entry.outgoing_ids])
        or "none",
        tag("span", "yes" if entry.dispatched else "not yet",
            class_="state running" if entry.dispatched else "state stale"),
    ]


def _split(key: str) -> tuple[str, str]:
    """A handler-scoped key's handler and message id (``Handler/message-id``)."""
    handler, _, message_id = key.rpartition("/")
    return handler, message_id or key
