"""``idembus sagas``: the sagas (and aggregates) an endpoint keeps, read from its storage.

    idembus sagas list package.module:endpoint --type TYPE [--completed] [--limit N]
                       [--after ID] [--prefix P] [--json]
    idembus sagas show package.module:endpoint TYPE ID [--entries N] [--json]

``list`` pages through the live sagas of one type in the order of their ids (``--completed``:
the tombstones of those that ended, until retention removes them), with their versions,
last commits and states; the next page starts ``--after`` the last id shown. ``show`` tells
one saga's story: whether it is live or when it ended and by which message, its state (a
tombstone's last state), and the messages it handled, oldest first, with their types, times,
what each sent and whether that was dispatched.

``TYPE`` is the stored aggregate type (a saga's state class name, or its handler's
``aggregate_type``); an unknown one is refused with the endpoint's types. An endpoint on a
process-local storage (MemoryStorage, an embedded mongomock) is refused with exit status 2:
another process cannot see its sagas.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from ..envelope import format_utc
from ..errors import ConfigurationError
from ..handlers.base import AggregateHandler
from ..runtime.loading import load_endpoint, refuse_process_local
from ..storage.base import AggregateRecord, AggregateStore, ProcessedMessage
from ..storage.errors import StorageAccessDenied
from .errors import printable

#: Most sagas one ``list`` shows.
MOST = 1000


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    sagas = commands.add_parser(
        "sagas", parents=[common],
        help="list an endpoint's live (or completed) sagas of a type, or show one's story")
    actions = sagas.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common],
                                 help="the live sagas of one type, a page at a time")
    listing.add_argument("endpoint", help="package.module:endpoint")
    listing.add_argument("--type", required=True, metavar="TYPE",
                         help="the stored aggregate type (the saga's state class name)")
    listing.add_argument("--completed", action="store_true",
                         help="list the completed ones (tombstones kept for the retention "
                              "period) instead of the live ones")
    listing.add_argument("--limit", type=int, default=50, metavar="N",
                         help=f"how many to list (50, at most {MOST})")
    listing.add_argument("--after", default=None, metavar="ID",
                         help="start after this id (the last one of the previous page)")
    listing.add_argument("--prefix", default="", metavar="P",
                         help="only ids that start with P")
    listing.add_argument("--json", action="store_true", help="print JSON instead of text")
    listing.set_defaults(handler=_list)
    show = actions.add_parser("show", parents=[common],
                              help="one saga: its state or last state, and the messages it "
                                   "handled with their types and times")
    show.add_argument("endpoint", help="package.module:endpoint")
    show.add_argument("type", metavar="TYPE", help="the stored aggregate type")
    show.add_argument("id", metavar="ID", help="the saga's id")
    show.add_argument("--entries", type=int, default=200, metavar="N",
                      help="show the newest N messages it handled (200)")
    show.add_argument("--json", action="store_true", help="print JSON instead of text")
    show.set_defaults(handler=_show)


def aggregate_types(endpoint: Any) -> list[str]:
    """The aggregate (and saga) types the endpoint's handlers keep, sorted."""
    return sorted({type(handler).storage_name() for handler in endpoint.table.handlers
                   if isinstance(handler, AggregateHandler)})


def _list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= MOST:
        raise ConfigurationError(f"--limit must be between 1 and {MOST}, got {args.limit}")
    endpoint = load_endpoint(args.endpoint)
    try:
        storage = _storage(endpoint, args.type)
        with _schema_hint(args.endpoint):
            page = storage.aggregate_page(args.type, completed=args.completed,
                                          after=args.after, limit=args.limit,
                                          id_prefix=args.prefix)
    finally:
        endpoint.close()
    listed = {
        "endpoint": endpoint.name, "type": args.type, "completed": args.completed,
        "sagas": [summary(record) for record in page],
        "next_after": page[-1].aggregate_id if len(page) == args.limit else None,
    }
    print(json.dumps(listed, indent=2) if args.json else render_list(listed))
    return 0


def _show(args: argparse.Namespace) -> int:
    if args.entries < 0:
        raise ConfigurationError(f"--entries must be 0 or more, got {args.entries}")
    endpoint = load_endpoint(args.endpoint)
    try:
        storage = _storage(endpoint, args.type)
        with _schema_hint(args.endpoint):
            record = storage.history(args.type, args.id, entries=args.entries)
    finally:
        endpoint.close()
    if not record.exists:
        raise ConfigurationError(
            f"endpoint {endpoint.name!r} keeps no {args.type} {args.id!r} (never started, or "
            "completed longer ago than the storage's retention)")
    told = story(record)
    print(json.dumps({"endpoint": endpoint.name, **told}, indent=2) if args.json
          else render_story(told))
    return 0


@contextlib.contextmanager
def _schema_hint(reference: str) -> Iterator[None]:
    """A storage whose schema is missing or older than this idembus (a table or column
    refused) fails saying what to run."""
    try:
        yield
    except StorageAccessDenied as refused:
        raise ConfigurationError(
            f"{refused}; if the storage's schema was never created or is older than this "
            f"idembus, run `idembus migrate {reference}`") from refused


def _storage(endpoint: Any, aggregate_type: str) -> AggregateStore:
    """The endpoint's aggregate storage, once the type is known to be one of its own."""
    refuse_process_local(endpoint.storage, endpoint=endpoint.name, role="storage",
                         unseen="sagas")
    known = aggregate_types(endpoint)
    if aggregate_type not in known:
        raise ConfigurationError(
            f"endpoint {endpoint.name!r} keeps no aggregate type {aggregate_type!r}; its "
            f"types: {', '.join(known) or 'none (no aggregate handler)'}")
    storage: AggregateStore = endpoint.storage_as(AggregateStore)
    return storage


def summary(record: AggregateRecord) -> dict[str, Any]:
    """One listed saga: id, version, last commit, and its state (a tombstone: its last)."""
    return {
        "id": record.aggregate_id, "version": record.version,
        "updated_at": format_utc(record.updated_at) if record.updated_at else None,
        "completed": record.completed,
        "state": _plain(record.final_state if record.completed else record.state),
    }


def story(record: AggregateRecord) -> dict[str, Any]:
    """One saga's story as a structure: its summary, the message that ended it, and the
    messages it handled (the newest the storage keeps), oldest first."""
    ended = record.ended_by()
    entries = sorted(record.processed.values(), key=lambda entry: (entry.at is None, entry.at))
    return {
        "type": record.aggregate_type, **summary(record),
        "state_version": record.state_version or 1,
        "ended_by": _entry(ended, ended) if ended is not None else None,
        "messages": [_entry(entry, ended) for entry in entries],
    }


def _entry(entry: ProcessedMessage, ended: ProcessedMessage | None) -> dict[str, Any]:
    handler, _, message_id = entry.key.rpartition("/")
    return {
        "message_type": entry.message_type, "message_id": message_id or entry.key,
        "handler": handler or None, "key": entry.key,
        "at": format_utc(entry.at) if entry.at else None,
        "outcome": "completed the saga" if entry is ended else "handled",
        "sent": list(entry.outgoing_ids), "dispatched": entry.dispatched,
    }


def _plain(state: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return dict(state) if state is not None else None


def render_list(listed: Mapping[str, Any]) -> str:
    """The listing as text, one line per saga."""
    kind = "completed" if listed["completed"] else "live"
    sagas = listed["sagas"]
    lines = [f"{listed['type']} of endpoint {listed['endpoint']}: {len(sagas)} {kind} "
             f"saga(s) listed"]
    width = max((len(printable(item["id"])) for item in sagas), default=2)
    if sagas:
        lines.append(f"{'ID':<{width}}  VERSION  {'UPDATED':<32}  "
                     f"{'LAST STATE' if listed['completed'] else 'STATE'}")
    for item in sagas:
        lines.append(f"{printable(item['id']):<{width}}  {item['version']:<7}  "
                     f"{item['updated_at'] or '-':<32}  {_state_line(item['state'])}")
    if listed["next_after"] is not None:
        lines.append(f"more: --after {printable(listed['next_after'])}")
    return "\n".join(lines)


def render_story(told: Mapping[str, Any]) -> str:
    """One saga's story as text."""
    title = f"{told['type']} {printable(told['id'])}"
    ended = told["ended_by"]
    if told["completed"]:
        how = (f"by {printable(ended['message_type'] or 'a message of unrecorded type')} "
               f"{printable(ended['message_id'])}" if ended else "(its last message is no "
               "longer kept)")
        lines = [f"{title}: completed at {told['updated_at'] or '?'} {how}",
                 f"  version {told['version']}, state version {told['state_version']}",
                 "  last state: " + (_state_line(told["state"]) if told["state"] is not None
                                     else "not kept")]
    else:
        lines = [f"{title}: live, last changed at {told['updated_at'] or '?'}",
                 f"  version {told['version']}, state version {told['state_version']}",
                 f"  state: {_state_line(told['state'])}"]
    lines.append(f"  messages handled ({len(told['messages'])}, oldest first):")
    for item in told["messages"]:
        sent = (f"sent {len(item['sent'])}, "
                f"{'dispatched' if item['dispatched'] else 'not dispatched yet'}"
                if item["sent"] else "sent nothing")
        mark = "  <- completed the saga" if item["outcome"] == "completed the saga" else ""
        lines.append(f"    {item['at'] or '?'}  "
                     f"{printable(item['message_type'] or '(type not recorded)')}  "
                     f"{printable(item['message_id'])}  by {printable(item['handler'] or '?')}"
                     f"  {sent}{mark}")
    if not told["messages"]:
        lines.append("    none kept")
    return "\n".join(lines)


def _state_line(state: Mapping[str, Any] | None) -> str:
    return printable(json.dumps(state, sort_keys=True)) if state is not None else "-"
