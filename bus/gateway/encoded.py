"""Journal entries encoded once, as Server-Sent Events, and shared by every client.

An entry's event does not depend on who receives it (filters only choose *which* events a
client gets), so the gateway encodes each entry once and hands the same ``bytes`` object to
every stream: the hub encodes what it fans out live, and clients catching up from the
storage find recent entries already encoded in the :class:`EventCache`.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..storage.base import JournalEntry
from . import sse

#: Bytes of encoded events the cache keeps (the least recently used go first).
CACHE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class Encoded:
    """A journal entry and its event, as sent."""

    entry: JournalEntry
    data: bytes


class Batch:
    """Consecutive encoded entries, as one read of the journal returned them."""

    def __init__(self, events: Iterable[Encoded]) -> None:
        self.events = tuple(events)

    def __len__(self) -> int:
        return len(self.events)

    @property
    def first(self) -> int:
        """The position of its first entry (0 if empty)."""
        return self.events[0].entry.position if self.events else 0

    @property
    def last(self) -> int:
        """The position of its last entry (0 if empty)."""
        return self.events[-1].entry.position if self.events else 0

    @functools.cached_property
    def joined(self) -> bytes:
        """Every event of the batch in one ``bytes``: joined once, for all the clients that
        want the whole batch."""
        return b"".join(event.data for event in self.events)


class EventCache:
    """Encodes journal entries, keeping the newest :data:`CACHE_BYTES` of events by position
    so that an entry is encoded once however many clients receive it. Thread-safe.

    ``current``: what an entry is read as before it is encoded and filtered (the gateway
    upcasts entries of older versions, :func:`idembus.runtime.journal.current_entry`)."""

    def __init__(self, budget: int = CACHE_BYTES,
                 current: Callable[[JournalEntry], JournalEntry] | None = None) -> None:
        self._current = current or (lambda entry: entry)
        self._budget = budget
        self._events: OrderedDict[int, bytes] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        #: Entries encoded so far (a cache miss each).
        self.encoded = 0

    def batch(self, entries: Iterable[JournalEntry]) -> Batch:
        """``entries`` encoded (from the cache where they are in it)."""
        current = [self._current(entry) for entry in entries]
        return Batch(Encoded(entry, self.encode(entry)) for entry in current)

    def encode(self, entry: JournalEntry) -> bytes:
        """The event of ``entry``, encoded now unless the cache has it."""
        with self._lock:
            data = self._events.get(entry.position)
            if data is not None:
                self._events.move_to_end(entry.position)
                return data
        data = sse.journal_event(entry)  # outside the lock: other threads go on meanwhile
        with self._lock:
            self.encoded += 1
            if entry.position not in self._events:
                self._events[entry.position] = data
                self._size += len(data)
                while self._size > self._budget and len(self._events) > 1:
                    _, dropped = self._events.popitem(last=False)
                    self._size -= len(dropped)
        return data
