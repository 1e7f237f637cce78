"""The event journal: the events an endpoint publishes, kept in order in its storage for
clients that cannot speak AMQP (``idembus gateway``).

Opt in per endpoint (``Endpoint(journal=True)``: every event it publishes) or per type
(``journal=[OrderPlaced, OrderShipped]``). An event is appended after the broker confirmed
it, together with its dispatch mark (``Storage.mark_dispatched(..., journal=...)``: on
PostgreSQL in the transaction that writes a batch of marks, elsewhere just before the mark),
wherever it was published: in a handler (with the aggregate the handler changed), in a unit
of work, sent again by the outbox relay or for a duplicate; outside handlers, right
after it was sent. A crash in between leaves it unmarked, so it is sent and appended again
later; the journal keeps each message id once.

Entries keep the body as it was published. A reader that knows the event types (the
gateway: the types its endpoint handles or journals) reads them in their current shape:
:func:`current_entry` upcasts an entry of an older ``idembus.message_version`` and gives
an entry found by an alias its current name (:mod:`idembus.evolution`).

Positions order appends, not commits: events of one aggregate committed one right after the
other by two threads or processes are appended as their dispatches complete, possibly in the
other order.

The journal belongs to the storage: endpoints sharing a storage share one journal, and its
retention (``JournalPolicy(retention=...)``, default 7 days) is applied by whichever
endpoint's outbox relay holds the lease — the shortest retention among them wins in
effect.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import headers as h
from ..envelope import Envelope
from ..errors import ConfigurationError, MessageError
from ..evolution import upcast_body
from ..logs import loggable
from ..messages import Event, Message, is_message_type, message_name, message_version
from ..registry import MessageRegistry
from ..storage.base import INBOX, JournalEntry, JournalStore
from .decoding import wire_version

log = logging.getLogger(__name__)

#: How long journal entries are kept unless the endpoint says otherwise.
DEFAULT_RETENTION = datetime.timedelta(days=7)


class Journal:
    """Appends the published events one endpoint journals to its storage's journal."""

    def __init__(self, storage: JournalStore, types: frozenset[str] | None,
                 message_types: Sequence[type[Event]] = ()) -> None:
        self._storage = storage
        #: Wire names of the journaled event types; ``None``: every event.
        self.types = types
        #: The journaled event types, where they were listed (``journal=[...]``).
        self.message_types = tuple(message_types)

    def wants(self, envelope: Envelope) -> bool:
        """True for a published event of a journaled type."""
        if envelope.headers.get(h.INTENT) != h.Intent.PUBLISH.value:
            return False
        return self.types is None or envelope.message_type in self.types

    def entries(self, envelopes: Iterable[Envelope], *, aggregate_type: str | None = None,
                aggregate_id: str | None = None) -> list[JournalEntry]:
        """The journal entries of the journaled events among ``envelopes``."""
        if aggregate_type == INBOX:  # a stateless handler: no aggregate to name
            aggregate_type = aggregate_id = None
        return [entry_of(envelope, aggregate_type, aggregate_id)
                for envelope in envelopes if self.wants(envelope)]

    def record(self, envelopes: Iterable[Envelope]) -> None:
        """Append the journaled ones among ``envelopes`` (dispatched outside handlers: no
        mark follows to carry them)."""
        entries = self.entries(envelopes)
        if entries:
            self._storage.append_journal(entries)


def entry_of(envelope: Envelope, aggregate_type: str | None,
             aggregate_id: str | None) -> JournalEntry:
    """The journal entry of a published event."""
    parents = envelope.headers.get(h.PARENTS, "")
    return JournalEntry(
        message_id=envelope.message_id, message_type=envelope.message_type,
        headers=dict(envelope.headers), body=envelope.body,
        aggregate_type=aggregate_type, aggregate_id=aggregate_id,
        parents=tuple(parent for parent in parents.split(",") if parent))


@dataclass(frozen=True)
class JournalPolicy:
    """What an endpoint journals (``Endpoint(journal=JournalPolicy(...))``): ``events`` is
    ``True`` for every event it publishes, ``False`` for none, or a list of Event types;
    entries are kept for ``retention``."""

    events: bool | Sequence[type[Event]] = True
    retention: datetime.timedelta = DEFAULT_RETENTION


def journal_for(
    storage: JournalStore, option: bool | Sequence[type[Event]] | None
) -> Journal | None:
    """The :class:`Journal` an endpoint's ``journal=`` option asks for, or ``None``."""
    if option is None or option is False:
        return None
    if option is True:
        return Journal(storage, None)
    if isinstance(option, (str, bytes)) or not isinstance(option, Sequence | frozenset | set):
        raise ConfigurationError(
            f"journal must be True, False or a list of Event types, got {option!r}")
    wrong = [kind for kind in option if not (is_message_type(kind) and issubclass(kind, Event))]
    if wrong or not option:
        raise ConfigurationError(
            f"journal lists {wrong or 'nothing'}: list the Event types to journal, or pass "
            "journal=True for every event the endpoint publishes")
    return Journal(storage, frozenset(message_name(kind) for kind in option), list(option))


def current_entry(entry: JournalEntry, known: MessageRegistry) -> JournalEntry:
    """``entry`` as its type's current version: the body upcast from its
    ``idembus.message_version``, the type named by its current wire name (an entry found by
    an alias), the version header set. An entry of a type ``known`` does not hold by name
    or alias, or already current, is returned as it is; so is one that cannot be upcast
    (logged: a reader of the journal cannot send it to an error queue, and the stream goes
    on; the entry keeps its version header, which says what shape its body has)."""
    if entry.message_type not in known:
        return entry
    message_type: type[Message] = known.resolve(entry.message_type)
    try:
        version = wire_version(entry.headers)
        current = message_version(message_type)
        if version == current and entry.message_type == message_name(message_type):
            return entry
        body = entry.body
        if version != current:
            body = json.dumps(upcast_body(message_type, json.loads(entry.body), version),
                              separators=(",", ":"))
    except (MessageError, ValueError) as exc:
        log.warning("journal entry %d (%s %s) is served as stored: %s", entry.position,
                    loggable(entry.message_type), loggable(entry.message_id),
                    loggable(str(exc), 2000))
        return entry
    name = message_name(message_type)
    headers = {**entry.headers, h.MESSAGE_TYPE: name, h.MESSAGE_VERSION: str(current)}
    return dataclasses.replace(entry, message_type=name, headers=headers, body=body)
