"""The failed messages of an endpoint (after ServicePulse's failed-message views): the
list with its groups and filters, one message whole, and retry or purge of one, a
selection or a filter, each after a confirmation page. Every operation goes through
:mod:`idembus.runtime.recoverability.error_queue`, as ``idembus errors`` does.

Every page first moves what waits in the error queue into the endpoint's storage
(:func:`idembus.error_queue.ingest`) and then reads the storage only: looking never hands a
message back to the broker, whose delivery limit would otherwise drop it after a few
looks. A confirmation page carries the storage ids of exactly the messages it lists (at
most :data:`CONFIRMED`); the confirmed POST acts on those ids, never on a filter
evaluated again.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from starlette.datastructures import ImmutableMultiDict

from .. import headers as h
from ..errors import ConfigurationError
from ..runtime.recoverability import error_queue
from ..runtime.recoverability.error_queue import FailedMessage, Selection
from ..runtime.recoverability.parking import ParkedDelivery
from ..storage.base import SETTLED_FROM_ERROR_QUEUE, ParkingStore, PayloadStore
from ..storage.claims import PREFIX as CLAIMED_PREFIX
from ..storage.claims import peek
from ..transports.base import Delivery
from .html import Child, Markup, render, tag, url
from .layout import hidden, moment, notice, pairs, pretty, table
from .pages import Page, Refused

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint

Params = ImmutableMultiDict[str, str]

#: What a confirmed action does, in words: (verb, past tense, what happens).
ACTIONS = {
    "retry": ("Retry", "retried", "Each goes back to the queue it failed in (a parked one to "
                                  "its own destination) with its failure headers removed and "
                                  "its id unchanged: handlers that had processed it find it "
                                  "processed."),
    "purge": ("Purge", "purged", "Each is deleted from the error queue (or the storage, if "
                                 "parked) for good. This cannot be undone."),
}
#: The form field carrying the storage id of a confirmed message.
KEY = "key"
#: The most messages one confirmation acts on (their ids fit in a form).
CONFIRMED = 2000
#: The filter's query parameters.
FILTERS = ("type", "exception", "after", "before")


def selection_of(params: Params) -> Selection:
    """The messages a request names: ``id`` (repeatable), a filter (``type``,
    ``exception``, ``after``, ``before``: times of failure, UTC, as ``YYYY-MM-DDTHH:MM``),
    or ``all=1``; :class:`~.pages.Refused` if none or several of them."""
    ids = tuple(value for value in params.getlist("id") if value)
    chosen = _filter_of(params)
    everything = params.get("all") == "1"
    if sum([bool(ids), chosen.by_filter, everything]) != 1:
        raise Refused("choose the messages: one or more ids, a filter, or all of them")
    if ids:
        return Selection(ids=ids)
    if everything:
        return Selection(everything=True)
    return chosen


def _filter_of(params: Params) -> Selection:
    return Selection(message_type=params.get("type") or None,
                     exception=params.get("exception") or None,
                     failed_after=_time(params, "after"), failed_before=_time(params, "before"))


def _time(params: Params, name: str) -> datetime.datetime | None:
    text = params.get(name) or ""
    if not text:
        return None
    try:
        moment_ = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise Refused(f"{name}: {text[:40]!r} is not a time; write YYYY-MM-DDTHH:MM (UTC)") \
            from None
    if moment_.tzinfo is None:
        moment_ = moment_.replace(tzinfo=datetime.timezone.utc)
    return moment_


def _fields(selection: Selection) -> list[tuple[str, object]]:
    """The query fields that name ``selection`` again."""
    if selection.ids:
        return [("id", message_id) for message_id in selection.ids]
    if selection.everything:
        return [("all", "1")]
    return [(name, value) for name, value in (
        ("type", selection.message_type), ("exception", selection.exception),
        ("after", _local(selection.failed_after)), ("before", _local(selection.failed_before)))
        if value is not None]


def _local(moment_: datetime.datetime | None) -> str | None:
    if moment_ is None:
        return None
    return moment_.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M")


# -- the list ----------------------------------------------------------------------------


def _outage(endpoint: Endpoint, outage: Exception | None) -> Child:
    """What a page read from the storage alone says: the broker could not be reached, so
    the messages still waiting in the error queue are not shown yet."""
    if outage is None:
        return None
    return notice(f"The broker cannot be reached, so {endpoint.error_queue} was not read: "
                  "shown are the failed messages already kept in the storage; those still "
                  "in the error queue appear once the broker is back. Retry and purge need "
                  "the broker.", "error")


def listing(endpoint: Endpoint, params: Params, *, limit: int) -> Page:
    """The endpoint's failed messages that pass the filter, at most ``limit`` rows (all
    counted), with groups by exception and type."""
    chosen = _filter_of(params)
    shown: list[FailedMessage] = []
    groups: Counter[tuple[str, str]] = Counter()
    total = parked = 0
    outage = error_queue.ingest_unless_unreachable(endpoint)
    for delivery in error_queue.stored(endpoint):
        failed = FailedMessage.of(delivery)
        groups[(failed.exception_type or "-", failed.message_type or "-")] += 1
        if not chosen.matches(delivery):
            continue
        total += 1
        parked += failed.parked
        if len(shown) < limit:
            shown.append(failed)
    name = endpoint.name
    body = [
        _outage(endpoint, outage),
        _outcome(params),
        _filter_form(name, params, sorted({t for _, t in groups if t != "-"})),
        tag("h2", f"{total} failed message(s)", " matching" if chosen.by_filter else "",
            f" ({parked} parked in the storage)" if parked else ""),
        _bulk_form(name, chosen, total) if total else None,
        notice(f"showing the first {limit} of {total}") if total > limit else None,
        _table(name, shown),
        tag("h2", "Groups"),
        table(["exception", "message type", "messages", ""],
              [[tag("code", exception), tag("code", message_type), str(count),
                tag("a", "show", href=url("/errors", {
                    "endpoint": name, "exception": None if exception == "-" else exception,
                    "type": None if message_type == "-" else message_type}))]
               for (exception, message_type), count in groups.most_common()],
              empty="the error queue holds nothing of this endpoint", class_="groups"),
    ]
    return Page("Failed messages", render(body))


def _outcome(params: Params) -> Markup | None:
    """What the action just confirmed did (numbers only: nothing from the query is shown)."""
    said = []
    for key in ("retried", "purged", "refused"):
        value = params.get(key, "")
        if value.isdigit():
            said.append(f"{int(value)} message(s) {key}" if key != "refused" else
                        f"{int(value)} could not be retried (no queue to go back to)")
    return notice("; ".join(said), "ok") if said else None


def _filter_form(endpoint: str, params: Params, types: list[str]) -> Markup:
    return tag(
        "form",
        hidden({"endpoint": endpoint}),
        tag("label", "message type ", tag("input", name="type", value=params.get("type", ""),
                                          list="types", size=24)),
        tag("datalist", [tag("option", value=t) for t in types], id="types"),
        tag("label", "exception ", tag("input", name="exception", size=20,
                                       value=params.get("exception", ""),
                                       placeholder="ValueError")),
        tag("label", "failed from ", tag("input", type="datetime-local", name="after",
                                         value=params.get("after", ""))),
        tag("label", "to ", tag("input", type="datetime-local", name="before",
                                value=params.get("before", ""))),
        tag("span", "(UTC)", class_="caption"),
        tag("button", "Filter", type="submit"),
        tag("a", "clear", href=url("/errors", {"endpoint": endpoint})),
        method="get", action="/errors", class_="filters")


def _bulk_form(endpoint: str, chosen: Selection, total: int) -> Markup:
    selection = chosen if chosen.by_filter else Selection(everything=True)
    what = "matching" if chosen.by_filter else "all"
    return tag("form", hidden([("endpoint", endpoint), *_fields(selection)]),
               tag("button", f"Retry {what} ({total})", type="submit", name="action",
                   value="retry"),
               tag("button", f"Purge {what} ({total})", type="submit", name="action",
                   value="purge", class_="danger"),
               method="get", action="/errors/confirm", class_="bulk")


def _table(endpoint: str, shown: Iterable[FailedMessage], *, selectable: bool = True) -> Markup:
    """The failed messages as a table; ``selectable``: with check boxes and the buttons that
    act on the ones ticked (not on a confirmation page, whose only action is the one it
    asks to confirm)."""
    rows: list[list[Child]] = []
    for failed in shown:
        rows.append([
            tag("input", type="checkbox", name="id", value=failed.message_id or "",
                disabled=not failed.message_id, aria_label="select") if selectable else "",
            tag("a", tag("code", failed.message_id or "(without id)"),
                href=url("/errors/message", {"endpoint": endpoint, "id": failed.message_id}))
            if failed.message_id else tag("code", "(without id)"),
            tag("code", failed.message_type or "-"),
            render([tag("code", failed.exception_type or "-"),
                    tag("div", _short(failed.exception_message), class_="caption")]),
            tag("code", failed.failed_queue or "-"),
            moment(failed.failed_at or failed.time_of_failure),
            f"{failed.immediate_attempts or 0}/{failed.delayed_attempts or 0}",
            "parked" if failed.parked else "error queue",
        ])
    listed = table(["", "message id", "type", "exception", "failed queue", "time of failure",
                    "attempts (imm./del.)", "kept in"], rows,
                   empty="no failed message", class_="failed")
    if not selectable:
        return listed
    return tag("form", hidden({"endpoint": endpoint}), listed,
               tag("div", tag("button", "Retry selected", type="submit", name="action",
                              value="retry"),
                   tag("button", "Purge selected", type="submit", name="action",
                       value="purge", class_="danger"), class_="actions"),
               method="get", action="/errors/confirm", class_="selection")


def _short(text: str | None, width: int = 120) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= width else line[: width - 1] + "…"


# -- one message -------------------------------------------------------------------------


def message(endpoint: Endpoint, params: Params) -> Page:
    """Every copy of one failed message: its story, stack trace, headers and body."""
    message_id = params.get("id") or ""
    if not message_id:
        raise Refused("which message? give its id")
    selection = Selection(ids=(message_id,))
    outage = error_queue.ingest_unless_unreachable(endpoint)
    copies = [delivery for delivery in error_queue.stored(endpoint)
              if selection.matches(delivery)]
    if not copies:
        raise Refused(f"no message {message_id!r} among the failed messages of "
                      f"{endpoint.name} (retried or purged meanwhile?)", 404)
    payloads = endpoint.context.payloads()
    body = [_outage(endpoint, outage), *(_copy(delivery, payloads) for delivery in copies)]
    body.append(tag("form", hidden({"endpoint": endpoint.name, "id": message_id}),
                    tag("button", "Retry", type="submit", name="action", value="retry"),
                    tag("button", "Purge", type="submit", name="action", value="purge",
                        class_="danger"),
                    method="get", action="/errors/confirm", class_="actions"))
    return Page(f"Failed message {message_id}", render(body))


def _copy(delivery: Delivery, payloads: PayloadStore | None = None) -> Markup:
    failed = FailedMessage.of(delivery)
    headers = delivery.headers
    return tag(
        "article",
        pairs([("message id", tag("code", failed.message_id or "-")),
               ("type", tag("code", failed.message_type or "-")),
               ("exception", tag("code", failed.exception_type or "-")),
               ("exception message", tag("span", failed.exception_message or "-",
                                         class_="exception-message")),
               ("failed queue", tag("code", failed.failed_queue or "-")),
               ("time of failure", moment(failed.failed_at or failed.time_of_failure)),
               ("attempts (immediate / delayed)",
                f"{failed.immediate_attempts or 0} / {failed.delayed_attempts or 0}"),
               ("kept in", "the storage (parked)" if failed.parked else "the error queue")]),
        tag("h2", "Stack trace"),
        tag("pre", headers.get(h.STACK_TRACE) or "(none recorded)", class_="code trace"),
        tag("h2", "Headers"),
        table(["name", "value"], [[tag("code", name), tag("code", value)]
                                  for name, value in sorted(headers.items())
                                  if name != h.STACK_TRACE], class_="headers"),
        tag("h2", "Body ", tag("span", delivery.content_type or "no content type",
                               class_="caption")),
        pretty(delivery.body.decode("utf-8", "replace")),
        *(_claimed(peeked) for peeked in peek(headers, payloads)),
        class_="copy")


def _claimed(peeked: dict[str, Any]) -> Markup:
    """What the payload store keeps for a claim-checked body or field (:func:`peek`):
    whether it was found, its size and its start, or why it cannot be read."""
    name = peeked["field"]
    title = "Claim-checked body" if name is None else f"Claim-checked field {name}"
    rows: list[tuple[Child, Child]] = [
        ("payload id", tag("code", peeked["payload_id"] or "-")),
        ("found", "yes" if peeked["found"] else "no"),
        ("bytes", str(peeked["bytes"]) if peeked["bytes"] is not None else "-")]
    if not peeked["found"]:
        rows.append(("cannot be read", tag("span", peeked["problem"], class_="exception-message")))
        return tag("section", tag("h2", title), pairs(rows), class_="claimed")
    more = f"the first {CLAIMED_PREFIX} characters" if peeked["truncated"] else "all of it"
    return tag("section", tag("h2", title, " ", tag("span", more, class_="caption")),
               pairs(rows), tag("pre", peeked["prefix"], class_="code"), class_="claimed")


# -- confirming and acting ---------------------------------------------------------------


def confirm(endpoint: Endpoint, params: Params, *, token: str, limit: int) -> Page:
    """What a retry or purge would act on, and the form that does it (POST, with the CSRF
    token and the storage id of each message listed)."""
    action = params.get("action", "")
    if action not in ACTIONS:
        raise Refused(f"no action {action[:20]!r}: retry or purge")
    verb, _, consequence = ACTIONS[action]
    selection = selection_of(params)
    chosen: list[FailedMessage] = []
    total = 0
    with error_queue.reading(endpoint) as deliveries:
        for delivery in deliveries:
            if selection.matches(delivery):
                total += 1
                if len(chosen) < CONFIRMED:
                    chosen.append(FailedMessage.of(delivery))
    found = {failed.message_id for failed in chosen}
    missing = [message_id for message_id in selection.ids if message_id not in found]
    back = tag("a", "Back to the failed messages", href=url("/errors", {"endpoint": endpoint.name}))
    if not chosen:
        return Page(f"{verb} failed messages", render([
            notice("No failed message matches: nothing to do.", "warn"), back]), 404)
    body = [
        tag("p", f"{verb} {len(chosen)} message(s) of {endpoint.name}? ", consequence,
            class_="question"),
        notice(f"not among the failed messages (retried or purged meanwhile?): "
               f"{', '.join(missing)}; the others are listed", "warn") if missing else None,
        notice(f"{total} match: this confirms the first {CONFIRMED}; repeat for the rest",
               "warn") if total > CONFIRMED else None,
        tag("form", hidden([("endpoint", endpoint.name),
                            *((KEY, failed.stored_id) for failed in chosen),
                            ("csrf_token", token)]),
            tag("button", f"Yes, {verb.lower()} {len(chosen)} message(s)", type="submit",
                class_="danger" if action == "purge" else None, id="confirm"),
            " ", back, method="post", action=f"/errors/{action}", class_="confirm"),
        _table(endpoint.name, chosen[:limit], selectable=False),
        notice(f"showing the first {limit} of {len(chosen)}") if len(chosen) > limit else None,
    ]
    return Page(f"{verb} failed messages", render(body))


def act(endpoint: Endpoint, action: str, form: Params) -> str:
    """Retry or purge the messages whose storage ids ``form`` carries (confirmed, its token
    checked); where to go next. :class:`~.pages.Refused` (409) changes nothing if one of
    them is gone (retried or purged meanwhile) or is not this endpoint's."""
    keys = list(dict.fromkeys(value for value in form.getlist(KEY) if value))
    if not keys:
        raise Refused("choose the messages on the confirmation page")
    if len(keys) > CONFIRMED:
        raise Refused(f"at most {CONFIRMED} messages at a time", 413)
    storage = endpoint.storage_as(ParkingStore)
    found = [parked for parked in storage.parked_by_ids(endpoint.name, keys)
             if parked.source != SETTLED_FROM_ERROR_QUEUE]
    if len(found) != len(keys):
        raise Refused(f"{len(keys) - len(found)} of the confirmed messages are no longer "
                      "among the failed messages of this endpoint (retried or purged "
                      "meanwhile?); nothing was changed: open the page again", 409)
    deliveries = [ParkedDelivery(storage, parked) for parked in found]
    done = refused = 0
    if action == "purge":
        done = error_queue.purge(endpoint, deliveries)
    for delivery in deliveries if action == "retry" else ():
        try:
            error_queue.retry(endpoint, delivery)
        except ConfigurationError:
            refused += 1
            continue
        done += 1
    outcome: dict[str, object] = {"endpoint": endpoint.name, ACTIONS[action][1]: done}
    if refused:
        outcome["refused"] = refused
    return url("/errors", outcome)
