"""``idembus errors``: look at, retry and purge the messages in an endpoint's error queue.

    idembus errors list  package.module:endpoint [--type T] [--exception E] [--json]
    idembus errors show  package.module:endpoint ID [--json]   (a claim-checked body resolved)
    idembus errors export package.module:endpoint FILE [--type T] [--exception E]
                                                       (claim-checked content resolved)
    idembus errors retry package.module:endpoint (ID... | --all | --type T | --exception E)
    idembus errors purge package.module:endpoint (ID... | --all | --type T | --exception E)
    idembus errors ingest package.module:endpoint

The endpoint is loaded (not started) for its transport, ``error_queue`` and storage, and
closed at the end. One whose broker or storage lives inside one process (memory://,
MemoryStorage, an embedded mongomock) is refused with exit status 2: another process
cannot see its error queue or its parked messages. Messages the broker refused even a place
in the error queue are parked in the storage (:mod:`idembus.runtime.recoverability.parking`):
they are listed, shown, retried and purged with the error queue's (``KEPT IN``: ``parked``);
a retried one goes to its own destination.

Every command first moves what waits in the error queue into the endpoint's storage
(:func:`idembus.error_queue.ingest`: each message acknowledged only once the storage has
it), then reads the storage only, a page (:data:`PAGE` messages) at a time: looking never
hands a message back to the broker, so a queue's delivery limit never counts a look, and
a long error queue never has to fit in memory. Messages that failed in another endpoint's
queue are given back to the shared error queue as fresh copies (with ``--all-endpoints``
they are moved too, filed under the endpoint that failed them). ``retry`` and ``purge``
count what the selection chooses, ask, and then act on exactly those, a page at a time: a
message that failed after the count is not among them.

``retry`` sends each selected message back to the queue that failed it
(``idembus.failed_queue``) with the failure headers removed, so its attempt counters start
again; its message id and everything else are unchanged, so handlers that had already
processed it find it processed. Only then is it removed from the error queue: a crash in
between leaves a copy in both queues, never none. ``--type`` matches the message type
exactly; ``--exception`` the exception type by its full or last dotted name
(``ValueError`` matches ``builtins.ValueError``); both together select what matches both.
An ID selects every copy of that message in the error queue.

Exit status: 0 on success; 2 when an ID is not in the error queue, the arguments are
wrong, or a selected message cannot be retried (it has no failed queue).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .. import headers as h
from ..envelope import parse_utc
from ..errors import ConfigurationError, MalformedMessage
from ..failures import without_failure_headers
from ..redaction import redact
from ..runtime.loading import load_endpoint, refuse_process_local
from ..runtime.recoverability import error_queue
from ..runtime.recoverability.error_queue import (
    PAGE,
    FailedMessage,
    Selection,
    Survey,
    exception_matches,
    retried_envelope,
)
from ..runtime.recoverability.parking import ParkedDelivery
from ..storage.base import ParkingStore, PayloadStore
from ..storage.claims import PREFIX, is_claimed, peek, references, resolved
from ..storage.errors import SchemaMissing, StorageError
from ..transports.base import Delivery
from ..transports.errors import TransportUnavailable
from .supervisor import EXIT_CONFIGURATION

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint

__all__ = ["PAGE", "FailedMessage", "Selection", "exception_matches", "printable",
           "register", "retried_envelope"]

#: Longest exception message shown by ``errors list`` (``--json`` gives it whole).
_SHORT_MESSAGE = 60
_MISSING = "-"


def _columns(message: FailedMessage) -> list[str]:
    """The cells of a message's row in ``errors list``."""
    return [
        message.message_id or _MISSING,
        message.message_type or _MISSING,
        message.exception_type or _MISSING,
        _shorten(message.exception_message or _MISSING, _SHORT_MESSAGE),
        message.failed_queue or _MISSING,
        _readable_time(message.time_of_failure),
        f"{message.immediate_attempts or 0}/{message.delayed_attempts or 0}",
        "parked" if message.parked else "error queue",
    ]


_COLUMN_TITLES = ["MESSAGE ID", "TYPE", "EXCEPTION", "MESSAGE", "FAILED QUEUE",
                  "TIME OF FAILURE (UTC)", "ATTEMPTS (IMM/DEL)", "KEPT IN"]


def _shorten(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _readable_time(text: str | None) -> str:
    """A time header as ``YYYY-MM-DD HH:MM:SS`` UTC (unchanged if unreadable)."""
    moment = parse_utc(text)
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else (text or _MISSING)


def _selection(args: argparse.Namespace) -> Selection:
    return Selection(ids=tuple(getattr(args, "ids", ()) or ()),
                     everything=bool(getattr(args, "all", False)),
                     message_type=args.type, exception=args.exception)


# -- commands ----------------------------------------------------------------------------


@contextmanager
def _endpoint(args: argparse.Namespace) -> Iterator[Endpoint]:
    """The endpoint (not started), closed after. One whose broker or storage lives inside
    one process is refused (its error queue and parked messages are out of this process's
    sight), and a broker or database that cannot be read is a ConfigurationError (exit
    status 2, one line): never "0 messages"."""
    endpoint = load_endpoint(args.endpoint)
    try:
        refuse_process_local(endpoint.transport, endpoint=endpoint.name, role="transport",
                             unseen="error queue")
        refuse_process_local(endpoint.storage, endpoint=endpoint.name, role="storage",
                             unseen="parked messages")
        yield endpoint
    except (TransportUnavailable, StorageError) as unreadable:
        cure = (f"; the storage has no tables yet — run `idembus migrate {args.endpoint}`"
                if isinstance(unreadable, SchemaMissing) else "")
        raise ConfigurationError(f"cannot read the failed messages of {endpoint.name}: "
                                 f"{redact(str(unreadable))}{cure}") from unreadable
    finally:
        endpoint.close()


@contextmanager
def _failed_messages(args: argparse.Namespace) -> Iterator[tuple[Endpoint, Iterator[Delivery]]]:
    """The endpoint and its failed messages one after the other, for commands that only
    read them (:func:`idembus.runtime.recoverability.error_queue.reading`: a page at a time)."""
    with _endpoint(args) as endpoint, \
            error_queue.reading(endpoint, all_endpoints=args.all_endpoints,
                                page=PAGE) as deliveries:
        yield endpoint, deliveries


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` safe for a terminal: control characters (an escape sequence a hostile
    message carries) shown as ``\\xNN``; with ``lines``, newlines and tabs kept."""
    kept = "\n\t" if lines else ""
    return "".join(character if character.isprintable() or character in kept
                   else f"\\x{ord(character):02x}" if ord(character) < 256
                   else f"\\u{ord(character):04x}" for character in text)


def _list(args: argparse.Namespace) -> int:
    selection = Selection(message_type=args.type, exception=args.exception)
    with _endpoint(args) as endpoint:
        if _has_tables(endpoint):
            with error_queue.reading(endpoint, all_endpoints=args.all_endpoints,
                                     page=PAGE) as deliveries:
                failed = (FailedMessage.of(d) for d in deliveries if selection.matches(d))
                count = _print_json(failed) if args.json else _print_rows(failed)
        else:
            count = _list_without_tables(args, endpoint, selection)
    if not args.json:
        print(f"{count} failed message(s) in {endpoint.error_queue!r}")
    return 0


def _has_tables(endpoint: Endpoint) -> bool:
    """Whether the endpoint's storage can keep failed messages: False when its tables were
    never created (``idembus migrate``); other failures are raised."""
    try:
        endpoint.storage_as(ParkingStore).parked_page(endpoint.name, limit=1)
    except SchemaMissing:
        return False
    return True


def _list_without_tables(args: argparse.Namespace, endpoint: Endpoint,
                         selection: Selection) -> int:
    """``errors list`` on a storage whose tables were never created: what waits in the
    error queue, looked at and left there (:func:`~idembus.runtime.recoverability.
    error_queue.look`), and a line saying there are no parked messages and what to run."""
    failed: list[FailedMessage] = []
    error_queue.look(endpoint, lambda delivery: failed.append(FailedMessage.of(delivery))
                     if selection.matches(delivery) else None,
                     all_endpoints=args.all_endpoints, page=PAGE)
    count = _print_json(failed) if args.json else _print_rows(failed)
    print(f"no parked messages: the storage has no tables yet — run `idembus migrate "
          f"{args.endpoint}` (the error queue's messages were listed and left in it)",
          file=sys.stderr if args.json else sys.stdout)
    return count


def _print_json(messages: Iterable[FailedMessage]) -> int:
    """Print ``messages`` as one JSON array (as ``json.dumps(..., indent=2)`` would), each
    as soon as it is read; how many there were."""
    count = 0
    for message in messages:
        text = textwrap.indent(json.dumps(asdict(message), indent=2), "  ")
        print(("[\n" if count == 0 else ",\n") + text, end="")
        count += 1
    print("\n]" if count else "[]")
    return count


def _print_rows(messages: Iterable[FailedMessage]) -> int:
    """Print ``messages`` as a table, :data:`PAGE` rows at a time (each column as wide as
    its widest cell so far); how many there were."""
    widths = [len(title) for title in _COLUMN_TITLES]
    rows: list[list[str]] = []
    count = 0
    for message in messages:
        if count == 0:
            rows.append(_COLUMN_TITLES)
        rows.append(_columns(message))
        count += 1
        if len(rows) >= PAGE:
            widths = _print_table(rows, widths)
            rows = []
    if rows:
        _print_table(rows, widths)
    return count


def _print_table(rows: list[list[str]], widths: list[int]) -> list[int]:
    """Print ``rows``, each column at least as wide as ``widths`` says; the widths used."""
    widths = [max(widths[column], *(len(row[column]) for row in rows))
              for column in range(len(widths))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        print(printable("  ".join(cells).rstrip()))
    return widths


def _show(args: argparse.Namespace) -> int:
    selection = Selection(ids=(args.id,))
    with _failed_messages(args) as (endpoint, deliveries):
        chosen = selection.pick([d for d in deliveries if selection.matches(d)],
                                endpoint.error_queue)
        payloads = endpoint.context.payloads()
        shown = [_described(delivery, payloads) for delivery in chosen]
    if args.json:
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    for index, message in enumerate(shown):
        if index:
            print()
        _print_message(message, endpoint.error_queue)
    return 0


def _described(delivery: Delivery, payloads: PayloadStore | None = None) -> dict[str, Any]:
    described: dict[str, Any] = {"headers": dict(sorted(delivery.headers.items())),
                 "content_type": delivery.content_type,
                 "body": delivery.body.decode("utf-8", "replace")}
    for peeked in peek(delivery.headers, payloads, prefix=CLAIMED_PREFIX):
        name = peeked.pop("field")
        if name is None:
            described["claim_check"] = peeked
        else:
            described.setdefault("claim_checked_fields", {})[name] = peeked
    return described


#: How much of a claim-checked body ``errors show`` prints.
CLAIMED_PREFIX = PREFIX


def _print_message(message: dict[str, Any], queue: str) -> None:
    message_id = message['headers'].get(h.MESSAGE_ID, '(without id)')
    print(printable(f"message {message_id} in {queue!r}"))
    print("headers:")
    for name, value in message["headers"].items():
        lines = str(value).splitlines() or [""]
        print(printable(f"  {name}: {lines[0]}"))
        for line in lines[1:]:
            print(printable(f"      {line}"))
    print(printable(f"body ({message['content_type'] or 'no content type'}):"))
    print(printable(message["body"], lines=True))
    claimed = [("claim-checked body", message["claim_check"])] if "claim_check" in message else []
    claimed += [(f"claim-checked field {name!r}", peeked)
                for name, peeked in message.get("claim_checked_fields", {}).items()]
    for what, peeked in claimed:
        if not peeked["found"]:
            print(printable(f"{what}: cannot be read: {peeked['problem']}"))
            continue
        more = f" (the first {CLAIMED_PREFIX} characters)" if peeked["truncated"] else ""
        print(printable(f"{what}, {peeked['bytes']} bytes{more}:"))
        print(printable(peeked["prefix"], lines=True))


def _export(args: argparse.Namespace) -> int:
    """Write the selected failed messages as JSON lines that ``idembus spark replay`` reads
    (message_id, message_type, body, headers without the failure story, and when and where
    it failed). A claim-checked message is written with its body (and fields) read back
    from the payload store, or, when they cannot be read, with its references and
    ``claim_check.problem`` saying why. They stay in the error queue: purge them once
    replayed."""
    selection = Selection(message_type=args.type, exception=args.exception)
    written = unread = 0
    with _failed_messages(args) as (endpoint, deliveries):
        payloads = endpoint.context.payloads()
        with open(args.file, "w", encoding="utf-8") as out:
            for delivery in (d for d in deliveries if selection.matches(d)):
                written += 1
                line = _exported(delivery, payloads)
                unread += "problem" in line.get("claim_check", {})
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
    print(f"{written} message(s) of {endpoint.error_queue!r} written to {args.file}")
    if unread:
        print(f"idembus: {unread} of them refer to claim-checked content that cannot be read: "
              "written with their references (see claim_check.problem)", file=sys.stderr)
    return 0


def _exported(delivery: Delivery, payloads: PayloadStore | None) -> dict[str, Any]:
    """One line of ``errors export``: a claim-checked message with its body (or fields)
    resolved and without the references, or with them and ``claim_check.problem``: why
    what they name cannot be read."""
    headers, body = without_failure_headers(delivery.headers), delivery.body
    claim: dict[str, Any] | None = None
    if is_claimed(delivery.headers):
        claim = {"payload_ids": [reference for _, reference in references(delivery.headers)]}
        try:
            body = resolved(delivery.headers, delivery.body, payloads)
        except MalformedMessage as unresolved:
            claim["problem"] = f"cannot be read: {unresolved.reason}"
        else:
            claim["resolved"] = True
            for name in CLAIM_HEADERS:
                headers.pop(name, None)
    line: dict[str, Any] = {
        "message_id": delivery.headers.get(h.MESSAGE_ID),
        "message_type": delivery.headers.get(h.MESSAGE_TYPE),
        "body": body.decode("utf-8", "replace"),
        "headers": json.dumps(headers),
        "failed_queue": delivery.headers.get(h.FAILED_QUEUE),
        "time_of_failure": delivery.headers.get(h.TIME_OF_FAILURE),
    }
    if claim is not None:
        line["claim_check"] = claim
    return line


#: The headers of a claim-checked message that an export with its content resolved drops.
CLAIM_HEADERS = (h.CLAIM_CHECK, h.CLAIM_CHECK_BYTES, h.CLAIM_CHECK_FIELDS)


def _chosen(args: argparse.Namespace, endpoint: Endpoint,
            selection: Selection) -> tuple[Survey, Iterator[list[ParkedDelivery]]]:
    """What the selection chooses now: counted, then a page at a time."""
    counted = error_queue.survey(endpoint, selection, all_endpoints=args.all_endpoints,
                                 page=PAGE)
    return counted, error_queue.chosen_pages(endpoint, selection, counted,
                                             all_endpoints=args.all_endpoints, page=PAGE)


def _ingest(args: argparse.Namespace) -> int:
    """Move what waits in the error queue into the storage, and say how many (every other
    command does it first; this is for a schedule that keeps the error queue empty)."""
    with _endpoint(args) as endpoint:
        moved = error_queue.ingest(endpoint, all_endpoints=args.all_endpoints, page=PAGE)
    print(f"{moved} message(s) moved from {endpoint.error_queue!r} into the storage")
    return 0


def _retry(args: argparse.Namespace) -> int:
    selection = _selection(args)
    selection.require("retry")
    status = retried = 0
    with _endpoint(args) as endpoint:
        _, pages = _chosen(args, endpoint, selection)
        for delivery in (delivery for page in pages for delivery in page):
            try:
                envelope = error_queue.retry(endpoint, delivery)
            except ConfigurationError as exc:
                print(f"idembus: {redact(str(exc))}; left in {endpoint.error_queue!r}",
                      file=sys.stderr)
                status = EXIT_CONFIGURATION
                continue
            retried += 1
            where = ("from the storage to "
                     f"{envelope.destination or 'its subscribers'!r}"
                     if FailedMessage.of(delivery).parked else f"to {envelope.destination!r}")
            print(f"retried {envelope.headers.get(h.MESSAGE_ID, '(without id)')} {where}")
    print(f"{retried} message(s) retried from {endpoint.error_queue!r}")
    return status


def _purge(args: argparse.Namespace) -> int:
    selection = _selection(args)
    selection.require("purge")
    purged = 0
    with _endpoint(args) as endpoint:
        counted, pages = _chosen(args, endpoint, selection)
        if args.dry_run:
            for delivery in (delivery for page in pages for delivery in page):
                print(printable(f"would purge {delivery.headers.get(h.MESSAGE_ID, '-')}"))
            print(f"{counted.count} message(s) would be purged from {endpoint.error_queue!r}")
            return 0
        if counted.count and not args.yes and not _confirmed(
                f"purge {counted.count} message(s) from {endpoint.error_queue!r} for good?"):
            print("nothing purged")
            return EXIT_CONFIGURATION
        for page in pages:
            purged += error_queue.purge(endpoint, page)
    print(f"{purged} message(s) purged from {endpoint.error_queue!r}")
    return 0


def _confirmed(question: str) -> bool:
    """Ask at a terminal; elsewhere (a script) refuse: ``--yes`` says it."""
    if not sys.stdin.isatty():
        raise ConfigurationError(f"{question} Not at a terminal: pass --yes to purge, or "
                                 "--dry-run to see what would go")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


# -- the command line --------------------------------------------------------------------


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``idembus errors {list,show,retry,purge}`` to the ``idembus`` command."""
    errors = commands.add_parser(
        "errors", help="list, show, retry or purge the messages in an endpoint's error queue",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = errors.add_subparsers(dest="errors_command", required=True)

    listing = _action(actions, common, "list", "one line per failed message", _list)
    _add_filters(listing)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")

    show = _action(actions, common, "show", "every header and the body of a message", _show)
    show.add_argument("id", help="message id (idembus.message_id)")
    show.add_argument("--json", action="store_true", help="print JSON")

    export = _action(actions, common, "export",
                     "write failed messages as JSON lines for idembus spark replay", _export)
    export.add_argument("file", help="the JSON lines file to write")
    _add_filters(export)

    _action(actions, common, "ingest",
            "move the error queue's messages into the endpoint's storage", _ingest)

    for name, summary, handler in (
        ("retry", "send messages back to the queue that failed them, counters reset", _retry),
        ("purge", "delete messages from the error queue for good", _purge),
    ):
        parser = _action(actions, common, name, summary, handler)
        parser.add_argument("ids", nargs="*", metavar="ID", help="message ids")
        parser.add_argument("--all", action="store_true", help="every message")
        _add_filters(parser)
        if name == "purge":
            parser.add_argument("--yes", action="store_true", help="do not ask")
            parser.add_argument("--dry-run", action="store_true",
                                help="list what would be purged, purge nothing")


def _action(actions: Any, common: argparse.ArgumentParser, name: str, summary: str,
            handler: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = actions.add_parser(
        name, parents=[common], help=summary, description=summary)
    parser.add_argument("endpoint", help="package.module:endpoint")
    parser.add_argument("--all-endpoints", action="store_true",
                        help="every message in the error queue, not only those that failed "
                             "in this endpoint's queue")
    parser.set_defaults(handler=handler)
    return parser


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--type", help="only messages of this message type (exact name)")
    parser.add_argument("--exception", help="only messages that failed with this exception "
                        "type (full or last dotted name: ValueError)")
