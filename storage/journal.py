"""Helpers the database backends share for the event journal (see :mod:`idembus.storage.base`)."""

from __future__ import annotations


def resume_position(*, newest: int, oldest: int | None, first_since: int | None) -> int | None:
    """What ``journal_position_at`` answers, from three positions of the journal.

    ``newest`` and ``oldest`` are the journal's bounds (0 and ``None`` when it is empty);
    ``first_since`` is the position of the first entry recorded at or after the moment
    asked about, ``None`` if there is none. Reading after the answer yields every entry
    recorded since the moment; ``None`` means older entries that may have been recorded
    since were trimmed. Read ``newest`` first: an entry appended after it was read is then
    still read after the answer.
    """
    if newest == 0 or oldest is None:
        return 0
    if first_since is None:
        return newest
    if first_since <= oldest and oldest > 1:
        return None
    return first_since - 1


def journal_size(oldest: int | None, newest: int) -> int:
    """How many entries the journal holds: positions are dense and trimming removes the
    oldest first, so the entries are exactly ``oldest..newest`` (no count query needed)."""
    return 0 if oldest is None else max(0, newest - oldest + 1)
