"""Looking at failed messages never consumes them; purge and retry act on what was shown.

Issue 24, findings 1, 7 and 10 (purge/retry part): ``idembus errors list/show`` and the
dashboard read the error queue with ``basic.get`` and gave every message back with
``basic.recover(requeue=True)``, which raises a quorum queue's ``x-delivery-count``: with
a delivery limit of 3 the broker dropped every failed message after a few looks. Purge
acked one by one and closed the channel at once (most "purged" messages came back), the
dashboard's confirmed purge re-evaluated its filter at POST time, and retry/purge took the
whole error queue into memory.

Now the error queue is an inbox: what is in it is moved into the endpoint's storage (each
broker message acknowledged once its write returned) and every view reads the storage.
The RabbitMQ tests need the ``h1``-style vhost of ``IDEMBUS_AMQP_URL``; every queue of the
test is declared with ``x-delivery-limit: 3``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import types
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.cli import main
from idembus.dashboard import Dashboard
from idembus.envelope import Envelope, format_utc, utc_now
from idembus.runtime.recoverability.parking import ParkedDelivery
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, required_transport
from tests.test_cli_errors import SharedMemoryStorage, shared_in_this_process

PASSWORD = "inbox-Pass-7"
LIMITED = {"x-delivery-limit": 3}


def failed_envelope(endpoint: str, error_queue_name: str, number: int,
                    exception: str = "builtins.ValueError") -> Envelope:
    """A failed message as the error queue holds it, failed in ``endpoint``'s queue."""
    return Envelope(
        {h.MESSAGE_ID: f"m-{number:04d}-{uuid.uuid4().hex[:6]}", h.MESSAGE_TYPE: "test.Deposit",
         h.FAILED_QUEUE: endpoint, h.EXCEPTION_TYPE: exception, h.EXCEPTION_MESSAGE: "no",
         h.TIME_OF_FAILURE: format_utc(utc_now())},
        json.dumps({"account": f"a-{number}", "amount": number}), error_queue_name)


class Tool:
    """``idembus errors`` and a dashboard over an endpoint that is not running, on one
    broker and one storage shared as another process would share them."""

    def __init__(self, url: str, name: str, queue: str, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str], **transport: Any) -> None:
        self.url, self.name, self.queue = url, name, queue
        self.options = transport
        self.storage = SharedMemoryStorage()
        self.capsys = capsys
        self.module = f"inbox_app_{uuid.uuid4().hex[:8]}"
        module = types.ModuleType(self.module)
        module.endpoint = self.endpoint  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, self.module, module)

    def transport(self) -> KombuTransport:
        return shared_in_this_process(KombuTransport(self.url, **self.options))

    def endpoint(self) -> Endpoint:
        return Endpoint(self.name, transport=self.transport(), storage=self.storage,
                        error_queue=self.queue)

    def errors(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        status = main(["errors", args[0], f"{self.module}:endpoint", *args[1:]])
        out, err = self.capsys.readouterr()
        return status, out, err

    def listed(self) -> list[str]:
        status, out, _ = self.errors("list", "--json")
        assert status == 0, out
        return sorted(row["message_id"] for row in json.loads(out))


@pytest.fixture
def amqp_url() -> str:
    return required_transport(AMQP_URL)


@pytest.fixture
def rabbit(amqp_url: str, unique: str, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> Iterator[Tool]:
    """A tool over a RabbitMQ error queue with a delivery limit of 3 (quorum), deleted
    afterwards."""
    tool = Tool(amqp_url, f"inbox-{unique}", f"inbox-error-{unique}", monkeypatch, capsys,
                queue_arguments=LIMITED, exchange=f"inbox-events-{unique}")
    transport = tool.transport()
    transport.declare(tool.queue)
    yield tool
    transport.delete_queue(tool.queue)
    transport.close()


def fill(tool: Tool, count: int, start: int = 0) -> list[str]:
    """Put ``count`` failed messages of the tool's endpoint into its error queue; return
    once the broker counts them all (a quorum queue counts a confirmed message a moment
    later)."""
    transport = tool.transport()
    ids = []
    try:
        before = transport.pending(tool.queue)
        for number in range(start, start + count):
            envelope = failed_envelope(tool.name, tool.queue, number)
            transport.send(envelope)
            ids.append(envelope.message_id)
        deadline = time.monotonic() + 10
        while transport.pending(tool.queue) < before + count:
            assert time.monotonic() < deadline, "the broker never counted them all"
            time.sleep(0.02)
    finally:
        transport.close()
    return sorted(ids)


def dashboard_of(tool: Tool) -> tuple[Dashboard, Endpoint, httpx.Client]:
    endpoint = tool.endpoint()
    dashboard = Dashboard([endpoint], port=0, auth=f"admin:{PASSWORD}")
    dashboard.start()
    client = httpx.Client(base_url=dashboard.url, auth=("admin", PASSWORD), timeout=30,
                          follow_redirects=False)
    return dashboard, endpoint, client


def confirmation(client: httpx.Client, **query: object) -> tuple[str, list[tuple[str, str]]]:
    """The confirmation page's POST action and its hidden fields."""
    page = client.get("/errors/confirm", params=query)
    assert page.status_code == 200, page.text
    action = re.search(r'<form[^>]*method="post" action="([^"]+)"', page.text)
    assert action is not None
    form = page.text[action.start():page.text.index("</form>", action.start())]
    return action.group(1), re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"',
                                       form)


# -- 1. looking never consumes ---------------------------------------------------------------


@pytest.mark.amqp
def test_a_hundred_looks_by_cli_and_dashboard_leave_every_failed_message_under_a_delivery_limit(
    rabbit: Tool,
) -> None:
    # Given 4 failed messages in a quorum error queue with x-delivery-limit 3
    ids = fill(rabbit, 4)
    dashboard, endpoint, client = dashboard_of(rabbit)
    try:
        # When they are looked at 100 times: the CLI's list and show, the dashboard's list,
        # message page and confirmation page
        for look in range(20):
            assert rabbit.listed() == ids, look
            status, out, _ = rabbit.errors("show", ids[look % 4], "--json")
            assert status == 0 and json.loads(out)[0]["headers"][h.MESSAGE_ID] == ids[look % 4]
            assert client.get("/errors").status_code == 200
            assert client.get("/errors/message", params={"id": ids[look % 4]}).status_code == 200
            assert client.get("/errors/confirm", params={"action": "purge", "all": "1"}
                              ).status_code == 200
        page = client.get("/errors").text
    finally:
        client.close()
        dashboard.stop(5)
        endpoint.close()

    # Then every one is still there, whole: listed, shown with its body, on every surface
    assert rabbit.listed() == ids
    assert "4 failed message(s)" in page
    for number, message_id in enumerate(ids):
        status, out, _ = rabbit.errors("show", message_id, "--json")
        assert status == 0
        assert json.loads(json.loads(out)[0]["body"]) == {"account": f"a-{number}",
                                                           "amount": number}


@pytest.mark.amqp
def test_a_cross_site_request_for_a_page_of_failed_messages_is_refused_and_changes_nothing(
    rabbit: Tool,
) -> None:
    # Given a failed message waiting in the error queue
    [message_id] = fill(rabbit, 1)
    dashboard, endpoint, client = dashboard_of(rabbit)
    try:
        # When another site's page makes the browser ask for the failed messages
        refused = [client.get(path, params=params, headers={"Sec-Fetch-Site": site})
                   for path, params in (("/errors", {}), ("/errors/message", {"id": message_id}),
                                        ("/errors/confirm", {"action": "purge", "all": "1"}))
                   for site in ("cross-site", "same-site")]
        waiting = endpoint.transport.pending(rabbit.queue)
        # ... while its own page (or an address typed by hand) is answered
        own = client.get("/errors", headers={"Sec-Fetch-Site": "same-origin"})
        typed = client.get("/errors", headers={"Sec-Fetch-Site": "none"})
    finally:
        client.close()
        dashboard.stop(5)
        endpoint.close()

    # Then each is refused before anything was read: the message still waits in the
    # error queue, nothing was moved
    assert [answer.status_code for answer in refused] == [403] * 6
    assert waiting == 1
    assert own.status_code == 200 and typed.status_code == 200 and message_id in own.text


# -- 2. purge and retry do what they say --------------------------------------------------------


@pytest.mark.amqp
def test_a_confirmed_purge_of_200_leaves_none_after_reconnecting_and_spares_a_later_failure(
    rabbit: Tool,
) -> None:
    # Given 200 failed messages, and the dashboard's confirmation of "purge all" for them
    fill(rabbit, 200)
    dashboard, endpoint, client = dashboard_of(rabbit)
    try:
        action, fields = confirmation(client, action="purge", all="1")
        assert sum(name == "key" for name, _ in fields) == 200
        # When another message fails before the confirmation is sent, and is seen
        [late] = fill(rabbit, 1, start=500)
        assert late in client.get("/errors").text
        done = client.post(action, data=dict(fields) | {"key": [v for n, v in fields
                                                                  if n == "key"]})
        assert done.status_code == 303, done.text
        said = client.get(done.headers["location"]).text
    finally:
        client.close()
        dashboard.stop(5)
        endpoint.close()

    # Then exactly the 200 confirmed were purged; the later one stays
    assert "200 message(s) purged" in said
    # And after reconnecting, none of them is back: the broker holds none, the storage none
    assert_none_back(rabbit, [late])


def assert_none_back(tool: Tool, remaining: list[str]) -> None:
    """Looked at again on new connections, only ``remaining`` are failed messages, and the
    error queue holds nothing."""
    for _ in range(2):
        assert tool.listed() == remaining
        fresh = tool.transport()
        try:
            assert fresh.pending(tool.queue) == 0
        finally:
            fresh.close()


@pytest.mark.amqp
def test_the_cli_purge_of_200_waits_for_the_broker_and_none_comes_back(rabbit: Tool) -> None:
    # Given 200 failed messages in the error queue
    fill(rabbit, 200)

    # When they are purged
    status, out, _ = rabbit.errors("purge", "--all", "--yes")

    # Then all 200 were purged, and after reconnecting none is back
    assert status == 0 and out.strip().endswith(f"200 message(s) purged from {rabbit.queue!r}")
    assert_none_back(rabbit, [])


class Held:
    """How many failed messages (broker deliveries, stored copies) this process holds at
    once: each counted from its creation until it is garbage."""

    def __init__(self) -> None:
        self.now = self.most = 0
        self._lock = threading.Lock()

    def created(self, thing: object) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        weakref.finalize(thing, self._released)

    def _released(self) -> None:
        with self._lock:
            self.now -= 1


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Held:
    import idembus.transports.kombu as kombu_transport

    spy = Held()
    for held_class in (kombu_transport._KombuDelivery, ParkedDelivery):
        original = held_class.__init__

        def counted(self: Any, *args: Any, __original: Callable[..., None] = original,
                    **kwargs: Any) -> None:
            __original(self, *args, **kwargs)
            spy.created(self)

        monkeypatch.setattr(held_class, "__init__", counted)
    return spy


@pytest.mark.parametrize("command", ["retry", "purge"])
def test_retry_and_purge_page_through_a_long_error_queue(
    command: str, held: Held, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    unique: str,
) -> None:
    # Given 150 failed messages in an error queue (memory://), read 10 at a time
    from idembus.cli import errors as cli_errors

    monkeypatch.setattr(cli_errors, "PAGE", 10)
    tool = Tool("memory://", f"long-{unique}", f"long-error-{unique}", monkeypatch, capsys)
    transport = tool.transport()
    transport.declare(tool.name)
    transport.declare(tool.queue)
    ids = fill(tool, 150)

    # When all are retried, or purged
    status, out, _ = tool.errors(command, "--all", *(("--yes",) if command == "purge" else ()))

    # Then the process never held more than about a page of them at once
    most = held.most
    assert 0 < most <= 2 * cli_errors.PAGE, most
    # And each went (back to its queue, or for good)
    done = {"retry": "retried", "purge": "purged"}[command]
    assert status == 0 and f"150 message(s) {done} from {tool.queue!r}" in out
    assert tool.listed() == []
    if command == "retry":
        with transport.inspect(tool.name) as back:
            assert sorted(d.headers[h.MESSAGE_ID] for d in back) == ids


@pytest.mark.amqp
def test_ingest_moves_the_error_queue_into_the_storage_and_leaves_other_endpoints_messages(
    rabbit: Tool,
) -> None:
    # Given two failed messages of this endpoint and one of another in a shared error queue
    ours = fill(rabbit, 2)
    transport = rabbit.transport()
    try:
        theirs = failed_envelope("another-endpoint", rabbit.queue, 9)
        transport.send(theirs)

        # When the error queue is moved into the storage, four times
        said = [rabbit.errors("ingest")[1].strip() for _ in range(4)]

        # Then ours moved once, and theirs waits in the error queue as a fresh message: its
        # delivery count not raised (a delivery limit of 3 would have dropped it)
        assert said[0] == f"2 message(s) moved from {rabbit.queue!r} into the storage"
        assert said[1:] == [f"0 message(s) moved from {rabbit.queue!r} into the storage"] * 3
        assert rabbit.listed() == ours
        with transport.inspect(rabbit.queue) as left:
            assert [d.headers[h.MESSAGE_ID] for d in left] == [theirs.message_id]
            assert left[0].body == theirs.body.encode()
            raw_headers = left[0]._message.headers  # type: ignore[attr-defined]
            assert raw_headers.get("x-delivery-count", 0) == 0
    finally:
        transport.close()
