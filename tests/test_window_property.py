"""Property: whatever the processed window (1–3) and wherever a process dies between commit
and dispatch, every committed outgoing message is eventually dispatched by the outbox, with
its id, exactly as stored — the window never forgets what was not sent."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idembus import headers as h
from idembus.envelope import Envelope, utc_now
from idembus.storage.memory import MemoryStorage
from idembus.storage.mongo import MongoStorage

#: One committed message: which aggregate, how many outgoing messages, whether the process
#: died before marking them dispatched, and whether the outbox runs a round afterwards.
steps = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 2), st.booleans(),
                           st.booleans()), min_size=1, max_size=25)


def outgoing(count: int) -> list[Envelope]:
    envelopes = []
    for _ in range(count):
        message_id = str(uuid.uuid4())
        envelopes.append(Envelope({h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposited",
                                   h.INTENT: "publish"}, f'{{"id": "{message_id}"}}'))
    return envelopes


def repair(storage: Any, sent: list[Envelope]) -> None:
    """One outbox round: send every undispatched entry's messages as stored, then mark."""
    later = utc_now() + datetime.timedelta(minutes=1)
    for entry in storage.undispatched(committed_before=later, limit=1000):
        sent.extend(entry.outgoing)
        storage.mark_dispatched(entry.aggregate_type, entry.aggregate_id, entry.key)


@pytest.mark.parametrize("backend", ["memory", "mongomock"])
@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 3), plan=steps)
def test_every_committed_message_is_dispatched_once_with_its_id_whatever_the_window(
    backend: str, window: int, plan: list[tuple[str, int, bool, bool]],
) -> None:
    storage: Any = (MemoryStorage(processed_window=window) if backend == "memory" else
                    MongoStorage.embedded(f"window-{uuid.uuid4().hex}", processed_window=window))
    committed: list[Envelope] = []
    sent: list[Envelope] = []
    for number, (aggregate, count, dies, outbox_runs) in enumerate(plan):
        messages = outgoing(count)
        loaded = storage.load("Account", aggregate)
        storage.commit(loaded, key=f"H/m{number}", state={"n": number}, outgoing=messages)
        committed.extend(messages)
        if not dies:
            sent.extend(messages)
            storage.mark_dispatched("Account", aggregate, f"H/m{number}")
        if outbox_runs:
            repair(storage, sent)
    repair(storage, sent)

    assert sorted(sent, key=lambda e: e.message_id) == sorted(committed,
                                                              key=lambda e: e.message_id)
    assert len({envelope.message_id for envelope in sent}) == len(sent)
