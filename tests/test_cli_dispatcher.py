"""`idembus dispatcher package.module:endpoint` runs the outbox dispatcher alone."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, POSTGRES_URL, require_service

pytestmark = [pytest.mark.amqp, pytest.mark.postgres]
ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_dispatcher_alone_sends_what_a_crash_left_and_stops_on_sigterm(tmp_path):
    # Given a commit whose message was never dispatched (the process died in between)
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    suffix = uuid.uuid4().hex[:10]
    prefix, queue = f"disp{suffix}", f"dispatched-{suffix}"
    storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
    storage.verify()
    transport = KombuTransport(AMQP_URL)
    transport.declare(queue)
    lost = Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit",
                     h.INTENT: "send"}, '{"account": "a", "amount": 1}', queue)
    storage.commit(storage.load("Account", "a", "H/m1"), key="H/m1", state={"n": 1},
                   outgoing=[lost])
    (tmp_path / "dispatch_app.py").write_text(textwrap.dedent(f'''
        from idembus import Endpoint
        from idembus.storage.postgres import PostgresStorage
        from tests.support import AccountHandler

        endpoint = Endpoint("dispatch-{suffix}", transport={AMQP_URL!r},
                            storage=PostgresStorage({POSTGRES_URL!r}, table_prefix={prefix!r}),
                            handlers=[AccountHandler], error_queue="error-{suffix}",
                            outbox_grace=0)
    '''))
    process = subprocess.Popen(
        [sys.executable, "-m", "idembus", "dispatcher", "dispatch_app:endpoint"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # When the dispatcher runs alone, Then the message arrives with its id
        deadline = time.monotonic() + 30
        arrived = None
        while arrived is None and time.monotonic() < deadline:
            arrived = transport.get(queue)  # another process: poll the queue
            if arrived is None:
                time.sleep(0.05)
        assert arrived is not None and arrived.headers[h.MESSAGE_ID] == lost.message_id
        assert storage.undispatched(committed_before=_soon()) == []

        # And SIGTERM stops it cleanly
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()
        transport.delete_queue(queue)
        transport.close()
        storage.drop_tables()
        storage.close()


def _soon():  # type: ignore[no-untyped-def]
    import datetime

    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=1)
