"""``idembus errors list`` on an endpoint whose PostgreSQL storage was never migrated: the
error queue is listed (and left as it was), with a line saying there are no parked messages
and what to run — not ``relation "…_parked" does not exist``."""

from __future__ import annotations

import json
import sys
import types
import uuid

import psycopg
import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.cli import main
from idembus.envelope import Envelope
from idembus.failures import failure_headers
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import POSTGRES_URL, require_service

pytestmark = pytest.mark.postgres


@pytest.fixture
def unmigrated(monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """An endpoint reference on memory:// (shared in this process) and PostgreSQL tables
    never created, with one failed message of its own in its error queue; the reference,
    the error queue, the message id."""
    require_service(POSTGRES_URL, "PostgreSQL")
    unique = uuid.uuid4().hex[:8]
    name, queue, prefix = f"unmigrated-{unique}", f"error-{unique}", f"never_{unique}"

    def endpoint() -> Endpoint:
        transport = KombuTransport("memory://")
        transport.process_local = False  # another process's broker, in this test
        return Endpoint(name, transport=transport, error_queue=queue,
                        storage=PostgresStorage(POSTGRES_URL, table_prefix=prefix,
                                                connect_timeout=5))

    module = types.ModuleType(f"unmigrated_app_{unique}")
    module.endpoint = endpoint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    message_id = str(uuid.uuid4())
    original = {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "shop.PlaceOrder"}
    sender = KombuTransport("memory://")
    sender.declare(queue)
    sender.dispatch(Envelope(failure_headers(original, ValueError("no stock"), queue=name,
                                             immediate_attempts=3, delayed_attempts=1),
                             '{"order_id": "1"}', queue))
    yield f"{module.__name__}:endpoint", queue, message_id
    assert not tables_of(prefix), "listing created no table"


def tables_of(prefix: str) -> list[str]:
    with psycopg.connect(POSTGRES_URL) as connection:
        rows = connection.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s",
                                  (f"{prefix}%",)).fetchall()
    return [row[0] for row in rows]


def test_errors_list_shows_the_error_queue_and_says_to_migrate(unmigrated, capsys):
    reference, queue, message_id = unmigrated

    status = main(["errors", "list", reference])
    out, err = capsys.readouterr()

    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("MESSAGE ID")
    assert lines[1].startswith(message_id) and "builtins.ValueError" in lines[1]
    assert "3/1" in lines[1]
    assert (f"no parked messages: the storage has no tables yet — run `idembus migrate "
            f"{reference}`") in out
    assert lines[-1] == f"1 failed message(s) in {queue!r}"
    assert "does not exist" not in out + err

    # And the message is still in the error queue: listed again, it is there again
    assert main(["errors", "list", reference, "--json"]) == 0
    out, err = capsys.readouterr()
    (row,) = json.loads(out)
    assert row["message_id"] == message_id
    assert (row["immediate_attempts"], row["delayed_attempts"]) == (3, 1)
    assert "no parked messages: the storage has no tables yet" in err


def test_other_errors_commands_say_to_migrate(unmigrated, capsys):
    reference, _, message_id = unmigrated
    assert main(["errors", "show", reference, message_id]) == 2
    err = capsys.readouterr().err
    assert "the storage has no tables yet — run `idembus migrate" in err
