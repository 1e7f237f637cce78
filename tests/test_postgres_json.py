"""The JSON parameters PostgresStorage writes with pydantic-core's encoder
(:mod:`idembus.storage.postgres_json`): the same JSON documents ``json.dumps`` wrote, the
same refusals, and a group commit of awkward text read back unchanged."""

from __future__ import annotations

import datetime
import json
import uuid
from collections.abc import Iterator
from types import MappingProxyType

import pytest

from idembus.envelope import Envelope
from idembus.storage.base import PendingCommit
from idembus.storage.errors import StorageError
from idembus.storage.postgres import PostgresStorage
from idembus.storage.postgres_json import row_with_state, text_json
from tests.conftest import POSTGRES_URL, require_service

AWKWARD = ['plain', 'quotes " and \\ backslashes', "control \x01\n\t", "é ü ß 中文 🎉",
           "", "</script>", "\u2028\u2029"]


def test_text_json_writes_the_document_json_dumps_writes():
    value = [{"text": text, "number": 12, "big": 2**70, "float": 1.5, "none": None,
              "yes": True, "list": [text, 0], "headers": {text or "empty": text}}
             for text in AWKWARD]
    assert json.loads(text_json(value)) == json.loads(json.dumps(value))


def test_what_the_quick_encoder_refuses_is_written_by_json_dumps_as_before():
    assert text_json(["\ud800"]) == json.dumps(["\ud800"])
    assert text_json({"x": float("nan")}) == '{"x":NaN}'  # PostgreSQL refuses it, as before


def test_a_state_is_written_by_json_dumps_which_refuses_what_json_cannot_hold():
    row = {"key": "H/1", "outgoing": []}
    assert json.loads(row_with_state(row, {"balance": 1})) == {**row, "state": {"balance": 1}}
    assert json.loads(row_with_state(row, None)) == {**row, "state": None}
    assert json.loads(row_with_state({}, {"a": "b"})) == {"state": {"a": "b"}}
    with pytest.raises(TypeError):
        row_with_state(row, {"at": datetime.datetime.now(datetime.timezone.utc)})


def test_a_state_is_the_text_json_dumps_writes_whatever_mapping_holds_it():
    state = {"name": "é\u2028\ud800", "n": [1, 2.5, None], "deep": {"ok": True}}
    expected = json.dumps(state)
    for given in (state, MappingProxyType(state)):
        assert row_with_state({"k": "v"}, given) == f'{{"k":"v","state":{expected}}}'
    assert json.dumps(state) == expected  # the given state is left as it was


@pytest.fixture
def storage() -> Iterator[PostgresStorage]:
    require_service(POSTGRES_URL, "PostgreSQL")
    store = PostgresStorage(POSTGRES_URL, table_prefix=f"pj{uuid.uuid4().hex[:12]}")
    store.migrate()
    yield store
    store.drop_tables()
    store.close()


@pytest.mark.postgres
def test_a_group_commit_of_awkward_text_reads_back_unchanged(storage: PostgresStorage):
    sent = {text: Envelope({"idembus.message_id": f"m{index}", "x-text": text}, text,
                           destination=text or None)
            for index, text in enumerate(AWKWARD)}
    commits = [PendingCommit(storage.load("Order", f"o{index}"), f"H/{index}",
                             {"note": text}, (envelope,), {"message_type": text})
               for index, (text, envelope) in enumerate(sent.items())]
    assert storage.commit_many(commits) == [None] * len(commits)
    again = [PendingCommit(storage.load("Order", f"o{index}"), f"H/again{index}",
                           {"note": text * 2}, (envelope,))
             for index, (text, envelope) in enumerate(sent.items())]
    assert storage.commit_many(again) == [None] * len(again)
    for index, (text, envelope) in enumerate(sent.items()):
        record = storage.load("Order", f"o{index}", f"H/{index}")
        assert record.state == {"note": text * 2}
        stored = record.processed[f"H/{index}"].outgoing[0]
        assert (stored.headers, stored.body, stored.destination) == (
            envelope.headers, envelope.body, envelope.destination)


@pytest.mark.postgres
def test_a_group_commit_with_a_lone_surrogate_is_refused_commit_by_commit(
        storage: PostgresStorage):
    bad = Envelope({"idembus.message_id": "m1"}, "half \ud800 a pair")
    good = Envelope({"idembus.message_id": "m2"}, "fine")
    answers = storage.commit_many([
        PendingCommit(storage.load("Order", "bad"), "H/bad", {"n": 1}, (bad,)),
        PendingCommit(storage.load("Order", "good"), "H/good", {"n": 2}, (good,))])
    assert isinstance(answers[0], StorageError) and answers[1] is None
    assert storage.load("Order", "good").state == {"n": 2}
    assert storage.load("Order", "bad").state is None


@pytest.mark.postgres
def test_states_are_read_back_as_json_loads_reads_them(storage: PostgresStorage):
    """The storage's connections parse ``jsonb`` with pydantic-core's parser: what PostgreSQL
    sends back of awkward states (big and negative numbers, floats, nesting, text) is the
    value ``json.loads`` reads from the same text."""
    states = [{"big": 2**70, "negative": -3, "float": 0.1, "tiny": 1e-300, "huge": 1.5e300,
               "exact": 12345678901234567890.0, "nested": [{"a": [None, True, False]}],
               "text": text, text or "empty": [text]} for text in AWKWARD]
    commits = [PendingCommit(storage.load("Order", f"s{index}"), f"H/s{index}", state, ())
               for index, state in enumerate(states)]
    assert storage.commit_many(commits) == [None] * len(commits)
    loaded = storage.load_many([("Order", f"s{index}", None) for index in range(len(states))])
    with storage._connection() as connection:
        texts = [row[0] for row in connection.execute(
            f"SELECT state::text FROM {storage.table_prefix}_aggregates "
            "WHERE aggregate_id LIKE 's%%' ORDER BY aggregate_id")]
    by_id = {record.aggregate_id: record.state for record in loaded}
    assert [by_id[f"s{index}"] for index in sorted(range(len(states)), key=str)] == [
        json.loads(text) for text in texts]
    assert by_id["s0"]["big"] == 2**70 and by_id["s0"]["float"] == 0.1  # (jsonb prints
    # 1.5e300 as its digits, which both parsers read as an int)
