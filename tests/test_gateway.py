"""The event gateway, read by a real HTTP client (httpx) over a socket: positions as ids,
resuming with Last-Event-ID, filters, full replication then live, slow clients, bad
requests, authentication, CORS, the client limit, the status and the health check."""

from __future__ import annotations

import datetime
import logging
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from idembus import Endpoint, Event
from idembus.errors import ConfigurationError
from idembus.gateway import Gateway
from idembus.gateway.server import UNAVAILABLE
from idembus.storage.base import StatusReport
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from tests.sse_client import Received, events, take
from tests.support import Account, AccountHandler, Deposit, Deposited, SignalCounter

STREAM = {"Accept": "text/event-stream"}


class VideoLiked(Event, message_name="test.VideoLiked"):
    video: str
    user: str
    note: str = ""

    def journal_parents(self) -> list[str]:
        return [f"video/{self.video}", f"user/{self.user}"]


@pytest.fixture
def accounts() -> Iterator[Endpoint]:
    endpoint = Endpoint(f"accounts-{uuid.uuid4().hex[:8]}", storage=MemoryStorage(),
                        handlers=[AccountHandler], journal=True)
    yield endpoint
    endpoint.close()


@pytest.fixture
def gateway_for() -> Iterator[Callable[..., Gateway]]:
    started: list[Gateway] = []

    def start(endpoint: Endpoint, **options: Any) -> Gateway:
        options.setdefault("poll_interval", 0.02)
        gateway = Gateway(endpoint, port=0, **options)
        gateway.start()
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


def deposit(endpoint: Endpoint, account: str, amount: int) -> str:
    """A unit of work on one account that publishes Deposited; returns the event's id."""
    with endpoint.unit_of_work(Account, account) as work:
        work.state.balance += amount
        work.state.deposits += 1
        return work.bus.publish(Deposited(account=account, amount=amount))


def like(endpoint: Endpoint, video: str, user: str, note: str = "") -> str:
    return endpoint.bus.publish(VideoLiked(video=video, user=user, note=note))


def stream(client: httpx.Client, gateway: Gateway, *, last: str | None = None,
           query: str = "") -> Any:
    headers = dict(STREAM)
    if last is not None:
        headers["Last-Event-ID"] = last
    return client.stream("GET", f"{gateway.url}/{query}", headers=headers,
                         timeout=httpx.Timeout(10.0))


def positions(received: list[Received]) -> list[int]:
    return [int(event.id) for event in received if event.id is not None]


def test_a_live_client_gets_each_event_with_its_position_type_body_and_headers(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    with httpx.Client() as client, stream(client, gateway) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = events(response)
        assert next(received).kind == "retry"  # sent once subscribed
        first = deposit(accounts, "a", 5)
        second = like(accounts, "v1", "u1")
        got = take(received, 2)
    assert [(event.kind, event.id) for event in got] == [
        ("test.Deposited", "1"), ("test.VideoLiked", "2")]
    assert got[0].data["body"] == {"account": "a", "amount": 5}
    assert got[0].data["headers"]["idembus.message_id"] == first
    assert (got[0].data["aggregate_type"], got[0].data["aggregate_id"]) == ("Account", "a")
    assert got[1].data["headers"]["idembus.message_id"] == second
    assert got[1].data["parents"] == ["video/v1", "user/u1"]
    assert got[1].data["aggregate_id"] is None


def test_resuming_with_last_event_id_loses_and_repeats_nothing(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    published = [deposit(accounts, f"a{n % 3}", n) for n in range(10)]
    with httpx.Client() as client:
        # A client that had events up to 3 reads four more, then its connection drops
        with stream(client, gateway, last="3") as response:
            first_part = take(events(response), 4)
        # Meanwhile more events are published; it comes back with the last id it saw
        published += [deposit(accounts, "a9", n) for n in range(5)]
        with stream(client, gateway, last=first_part[-1].id) as response:
            second_part = take(events(response), 15 - 7)
    received = first_part + second_part
    assert positions(received) == list(range(4, 16))
    ids = [event.data["headers"]["idembus.message_id"] for event in received]
    assert ids == published[3:]


def test_the_query_parameter_resumes_for_clients_that_cannot_set_headers(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    for n in range(4):
        deposit(accounts, "a", n)
    with httpx.Client() as client, stream(client, gateway, query="?last_event_id=2") as response:
        assert positions(take(events(response), 2)) == [3, 4]


def test_types_and_parents_filter_the_stream(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    like(accounts, "v1", "1")           # 1
    deposit(accounts, "a", 1)           # 2
    like(accounts, "v2", "42")          # 3
    like(accounts, "v7", "2")           # 4
    deposit(accounts, "b", 2)           # 5
    like(accounts, "v7", "42")          # 6
    deposit(accounts, "a", 3)           # 7

    with httpx.Client() as client:
        def read(query: str, count: int) -> list[int]:
            """The first ``count`` events after position 1 that pass the filter."""
            with stream(client, gateway, last="1", query=query) as response:
                return positions(take(events(response), count))

        assert read("?types=test.VideoLiked", 3) == [3, 4, 6]
        assert read("?parents=user/42", 2) == [3, 6]
        assert read("?parents=user/42,video/v7", 3) == [3, 4, 6]
        assert read("?types=test.VideoLiked&parents=video/v7", 2) == [4, 6]
        # An event's aggregate is a parent too, and an aggregate type selects its events
        assert read("?parents=Account/a", 2) == [2, 7]
        assert read("?types=Account", 3) == [2, 5, 7]


def test_full_replication_sends_every_state_then_switches_to_live_without_losing_an_event(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    # Given twenty accounts, and a publisher that keeps depositing while a client replicates
    for n in range(20):
        deposit(accounts, f"acc{n}", 100)
    gateway = gateway_for(accounts)
    stop_publishing = threading.Event()
    publisher_started = threading.Event()
    published_during: list[str] = []

    def publish() -> None:
        n = 0
        while not stop_publishing.is_set():
            published_during.append(deposit(accounts, f"acc{n % 25}", 1))
            publisher_started.set()
            n += 1

    publisher = threading.Thread(target=publish)
    publisher.start()
    assert publisher_started.wait(10)
    with httpx.Client() as client, stream(client, gateway, last="0") as response:
        received = events(response)
        assert next(received).kind == "retry"
        reset = next(received)
        states: dict[str, dict[str, Any]] = {}
        for event in received:
            if event.kind == "live":
                live = event
                break
            assert event.kind == "Account" and event.id is None
            states[event.data["aggregate_id"]] = event.data
        # Then, after the switch, it keeps reading until the publisher's last event
        stop_publishing.set()
        publisher.join()
        newest = accounts.storage.journal_bounds().newest
        after = take(received, newest - int(live.id)) if newest > int(live.id) else []

    assert reset.kind == "reset" and "full replication" in reset.data["reason"]
    assert int(live.id) == live.data["position"] == reset.data["position"]
    assert {f"acc{n}" for n in range(20)} <= set(states)
    assert states["acc3"]["state"]["balance"] >= 100
    # Every event after the live position arrives, once, in order: none lost in the switch
    assert positions(after) == list(range(int(live.id) + 1, newest + 1))
    journaled = {entry.message_id for entry in accounts.storage.read_journal(
        after=int(live.id), limit=100_000)}
    assert {event.data["headers"]["idembus.message_id"] for event in after} == journaled
    assert len(published_during) > 0


def test_an_id_older_than_the_retention_gets_a_reset_and_replication(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    for n in range(5):
        deposit(accounts, f"a{n}", 1)
    accounts.storage.trim_journal(
        datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1), batch=3)
    gateway = gateway_for(accounts)  # the journal now holds positions 4 and 5
    with httpx.Client() as client:
        with stream(client, gateway, last="2") as response:
            reset, *states, live = take(events(response), 7)
        with stream(client, gateway, last="3") as response:
            (next_event,) = take(events(response), 1)
    assert reset.kind == "reset" and "older than the journal's retention" in reset.data["reason"]
    assert sorted(state.data["aggregate_id"] for state in states) == [f"a{n}" for n in range(5)]
    assert (live.kind, live.id) == ("live", "5")
    assert next_event.id == "4"  # 3 is the last trimmed position: nothing is missing after it


def test_a_millisecond_timestamp_resumes_from_the_journal_when_it_reaches_back_that_far(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    deposit(accounts, "a", 1)
    deposit(accounts, "b", 1)
    (_, second) = accounts.storage.read_journal(after=0)
    assert second.recorded_at is not None
    millis = int(second.recorded_at.timestamp() * 1000)
    gateway = gateway_for(accounts)
    with httpx.Client() as client, stream(client, gateway, last=str(millis)) as response:
        (first_received,) = take(events(response), 1)
    assert first_received.kind == "test.Deposited"
    assert int(first_received.id or 0) <= 2
    assert first_received.data["aggregate_id"] in ("a", "b")


@pytest.mark.parametrize(("value", "reason"), [
    ("abc", "is not a journal position"),
    ("-1", "is not a journal position"),
    ("1.5", "is not a journal position"),
    ("99", "ahead of the journal"),
    ("99999999999999", "in the future"),
    ("99999999999999999999", "out of range"),
    ("9" * 5000, "out of range"),
])
def test_a_bad_last_event_id_gets_a_400_with_the_reason(
    accounts: Endpoint, gateway_for: Callable[..., Gateway], value: str, reason: str,
) -> None:
    deposit(accounts, "a", 1)
    gateway = gateway_for(accounts)
    response = httpx.get(gateway.url + "/", headers={**STREAM, "Last-Event-ID": value})
    assert response.status_code == 400
    assert reason in response.json()["error"]
    assert gateway.status()["rejected"] == 1


@pytest.mark.parametrize(("query", "reason"), [
    ("?type=x", "unknown query parameter(s) type"),
    ("?types=", "without empty items"),
    ("?parents=user/1,,user/2", "without empty items"),
])
def test_bad_filters_get_a_400_with_the_reason(
    accounts: Endpoint, gateway_for: Callable[..., Gateway], query: str, reason: str,
) -> None:
    gateway = gateway_for(accounts)
    response = httpx.get(f"{gateway.url}/{query}", headers=STREAM)
    assert response.status_code == 400
    assert reason in response.json()["error"]


def test_a_client_that_does_not_accept_event_streams_is_told_so(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    response = httpx.get(gateway.url + "/", headers={"Accept": "application/json"})
    assert response.status_code == 406
    assert "text/event-stream" in response.json()["error"]
    assert httpx.get(gateway.url + "/nowhere").status_code == 404


def test_basic_authentication_guards_the_stream_and_the_status(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts, auth="reader:s3cret")
    assert httpx.get(gateway.url + "/status").status_code == 401
    wrong = httpx.get(gateway.url + "/", headers=STREAM, auth=("reader", "guess"))
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"].startswith("Basic")
    assert httpx.get(gateway.url + "/status", auth=("reader", "s3cret")).status_code == 200
    deposit(accounts, "a", 1)
    with httpx.Client(auth=("reader", "s3cret")) as client, \
            stream(client, gateway, last="0") as response:
        assert response.status_code == 200
        assert take(events(response), 1)[0].kind == "reset"
    assert gateway.status()["unauthorized"] == 2


def test_the_status_counts_clients_events_the_journal_and_the_endpoint(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    for n in range(3):
        deposit(accounts, "a", n)
    with httpx.Client() as client:
        with stream(client, gateway, last="0") as response:
            received = events(response)
            take(received, 3)  # reset, the one account's state, live
            deposit(accounts, "a", 9)
            take(received, 1)
            status = client.get(gateway.url + "/status").json()
    assert status["clients"] == 1 and status["connections"] == 1
    assert status["replications"] == 1 and status["states_sent"] == 1
    assert status["events_sent"] == 1
    assert status["journal"] == {"size": 4, "oldest": 1, "newest": 4}
    assert status["endpoint"]["name"] == accounts.name
    assert status["endpoint"]["counters"]["handled"] == 0


def test_the_status_shows_the_endpoint_counters_from_its_signals(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts)
    handled = SignalCounter(accounts, "handled")
    accounts.start()
    accounts.bus.send(Deposit(account="a", amount=3), to=accounts.name)
    assert handled.wait_for(1)
    status = httpx.get(gateway.url + "/status").json()
    assert status["endpoint"]["counters"]["handled"] == 1
    assert status["endpoint"]["counters"]["received"] == 1


def test_a_slow_client_is_disconnected_when_its_buffer_fills_and_resumes_without_a_gap(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts, buffer=50)
    like(accounts, "v0", "1")
    count, note = 3000, "x" * 4000  # ~12 MB: more than the sockets' buffers hold
    with httpx.Client() as client:
        with stream(client, gateway, last="1") as response:
            received = events(response)
            assert next(received).kind == "retry"
            # While the client reads nothing, publishing goes on unhindered
            publisher = threading.Thread(
                target=lambda: [like(accounts, f"v{n}", "1", note) for n in range(count)])
            publisher.start()
            publisher.join(120)
            assert not publisher.is_alive()
            assert gateway.hub.wait_for_position(count + 1, timeout=60)
            # The client then reads what reached it before it was cut off, up to the end
            first_part = list(received)
        assert len(first_part) < count
        assert gateway.status()["overflows"] == 1
        last = first_part[-1].id if first_part else "1"
        with stream(client, gateway, last=last) as response:
            rest = take(events(response), count - len(first_part))
    assert positions(first_part + rest) == list(range(2, count + 2))


class JournalUnreachable(MemoryStorage):
    """A storage whose database is gone once ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def journal_bounds(self) -> Any:
        if self.down:
            raise StorageUnavailable("connection refused")
        return super().journal_bounds()

    def read_journal(self, *args: Any, **options: Any) -> Any:
        if self.down:
            raise StorageUnavailable("connection refused")
        return super().read_journal(*args, **options)


def test_an_unreachable_storage_gets_a_503_not_a_broken_stream(
    gateway_for: Callable[..., Gateway], caplog: pytest.LogCaptureFixture,
) -> None:
    storage = JournalUnreachable()
    endpoint = Endpoint(f"accounts-{uuid.uuid4().hex[:8]}", storage=storage, journal=True)
    try:
        gateway = gateway_for(endpoint)
        storage.down = True
        response = httpx.get(gateway.url + "/", headers={**STREAM, "Last-Event-ID": "1"})
        assert response.status_code == 503
        assert response.json()["error"] == UNAVAILABLE  # the reason only in the log
        assert "connection refused" in "\n".join(r.getMessage() for r in caplog.records)
        assert httpx.get(gateway.url + "/status").status_code == 503
    finally:
        endpoint.close()


def test_clients_cut_off_at_random_points_resume_without_loss_or_repeat_while_writers_run(
    storage_factory: Callable[..., Any], gateway_for: Callable[..., Gateway],
) -> None:
    # Given three writers that will commit and publish concurrently on one storage
    storage = storage_factory()
    endpoint = Endpoint(f"accounts-{uuid.uuid4().hex[:8]}", storage=storage,
                        handlers=[AccountHandler], journal=True)
    gateway = gateway_for(endpoint)
    writes, cut_points = 3 * 60, random.Random(7)

    def write(writer: int) -> None:
        for n in range(writes // 3):
            deposit(endpoint, f"w{writer}-{n % 7}", 1)

    writers = [threading.Thread(target=write, args=(w,)) for w in range(3)]
    received: list[Received] = []
    try:
        with httpx.Client(timeout=15.0) as client:
            # A client replicates the (empty) state, then the writers start
            with stream(client, gateway, last="0") as response:
                first_stream = events(response)
                reset, live = take(first_stream, 2)
                for writer in writers:
                    writer.start()
                received += take(first_stream, cut_points.randint(1, 25))
            # When it keeps getting cut off after a few events and resuming
            while len(received) < writes:
                with stream(client, gateway, last=received[-1].id) as response:
                    wanted = min(cut_points.randint(1, 25), writes - len(received))
                    received += take(events(response), wanted)
    finally:
        for writer in writers:
            writer.join()
        gateway.stop()
        endpoint.transport.close()  # the storage is the fixture's to close
    # Then it got every journal position once, in order, with the journaled message ids
    assert (reset.kind, live.kind, live.id) == ("reset", "live", "0")
    everything = storage.read_journal(after=0, limit=10_000)
    assert len(everything) == writes
    assert positions(received) == [entry.position for entry in everything]
    assert [event.data["headers"]["idembus.message_id"] for event in received] == [
        entry.message_id for entry in everything]


def test_pages_of_an_allowed_origin_may_read_the_stream_and_others_may_not(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts, auth="u:p", cors_origins=["https://app.example.com"])
    app = {"Origin": "https://app.example.com"}
    preflight = httpx.options(gateway.url + "/", headers={
        **app, "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "last-event-id, authorization"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "Last-Event-ID" in preflight.headers["access-control-allow-headers"]
    allowed = httpx.get(gateway.url + "/status", headers=app, auth=("u", "p"))
    assert allowed.headers["access-control-allow-origin"] == "https://app.example.com"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    deposit(accounts, "a", 1)
    with httpx.Client(auth=("u", "p")) as client, client.stream(
            "GET", gateway.url + "/", headers={**STREAM, **app, "Last-Event-ID": "0"},
            timeout=10.0) as response:
        assert response.headers["access-control-allow-origin"] == "https://app.example.com"
        assert take(events(response), 1)[0].kind == "reset"
    other = httpx.get(gateway.url + "/status", headers={"Origin": "https://evil.example"},
                      auth=("u", "p"))
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-methods" not in httpx.options(
        gateway.url + "/", headers={"Origin": "https://evil.example"}).headers


def test_a_timestamp_older_than_the_journal_replicates_what_changed_since(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    deposit(accounts, "before", 1)  # position 1, changed before the timestamp
    (first,) = accounts.storage.read_journal(after=0)
    assert first.recorded_at is not None
    millis = str(int(first.recorded_at.timestamp() * 1000) + 1)  # just after it
    ready = first.recorded_at + datetime.timedelta(milliseconds=2)
    while datetime.datetime.now(datetime.timezone.utc) <= ready:  # the next ones come later
        threading.Event().wait(0.001)
    deposit(accounts, "after-1", 1)  # 2
    deposit(accounts, "after-2", 1)  # 3
    accounts.storage.trim_journal(
        datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1), batch=1)
    gateway = gateway_for(accounts)
    with httpx.Client() as client, stream(client, gateway, last=millis) as response:
        reset, *states, live = take(events(response), 4)
    assert reset.kind == "reset" and "no longer reaches back" in reset.data["reason"]
    assert sorted(state.data["aggregate_id"] for state in states) == ["after-1", "after-2"]
    assert (live.kind, live.id) == ("live", "3")


def test_a_client_that_hangs_up_while_the_stream_is_idle_is_let_go(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts, heartbeat=3600.0)  # no keep-alive write would notice
    with httpx.Client() as client, stream(client, gateway) as response:
        received = events(response)  # kept: dropping the reader closes the connection
        assert next(received).kind == "retry"
        assert gateway.status()["clients"] == 1
    assert gateway.counters.wait_until(lambda counters: counters.clients == 0, timeout=10)
    assert gateway.status()["connections"] == 1


class BrokenStorage(MemoryStorage):
    """A storage that fails, once ``broken`` names what, with a password in its message
    (as a driver's error may carry its connection string)."""

    PASSWORD = "Gw7;Broken,Pw)Never'Shown"

    def __init__(self) -> None:
        super().__init__()
        self.broken: str | None = None

    def _fail(self, what: str) -> None:
        if self.broken == what:
            raise RuntimeError(f"{what} failed on host=db password={self.PASSWORD} dbname=x")

    def journal_bounds(self) -> Any:
        self._fail("journal_bounds")
        return super().journal_bounds()

    def records(self, aggregate_type: str) -> Any:
        self._fail("records")
        return super().records(aggregate_type)


def fragments_of(password: str) -> list[str]:
    """The pieces of ``password`` between its punctuation: none may be shown."""
    return [piece for piece in "".join(c if c.isalnum() else " " for c in password).split()]


def test_an_unexpected_error_answers_500_naming_only_its_type_and_is_logged_redacted(
    gateway_for: Callable[..., Gateway], caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    storage = BrokenStorage()
    endpoint = Endpoint(f"accounts-{uuid.uuid4().hex[:8]}", storage=storage, journal=True)
    try:
        gateway = gateway_for(endpoint)
        storage.broken = "journal_bounds"
        for response in (httpx.get(gateway.url + "/status"),
                         httpx.get(gateway.url + "/", headers={**STREAM, "Last-Event-ID": "1"})):
            assert response.status_code == 500
            assert "RuntimeError" in response.json()["error"]
            assert "failed on" not in response.text
    finally:
        endpoint.close()
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert "journal_bounds failed on host=db password=*** dbname=x" in logged
    shown = logged + "".join(capsys.readouterr())
    assert not [piece for piece in fragments_of(BrokenStorage.PASSWORD) if piece in shown]


def test_an_error_after_a_stream_began_is_logged_redacted_not_printed_raw(
    gateway_for: Callable[..., Gateway], caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given a storage whose aggregates cannot be read, and one to replicate
    storage = BrokenStorage()
    endpoint = Endpoint(f"accounts-{uuid.uuid4().hex[:8]}", storage=storage,
                        handlers=[AccountHandler], journal=True)
    try:
        deposit(endpoint, "a", 1)
        gateway = gateway_for(endpoint)
        storage.broken = "records"

        # When a client asks for replication: the stream has begun when reading fails
        with httpx.Client() as client, stream(client, gateway, last="0") as response:
            assert response.status_code == 200
            received = take(events(response), 3)
        assert [event.kind for event in received] == ["reset"]  # then the server hung up
        assert gateway.counters.wait_until(lambda counters: counters.clients == 0,
                                           timeout=10)
    finally:
        endpoint.close()

    # Then the traceback went to the log, redacted, and nothing raw to stderr
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert "Traceback" in logged and "records failed on host=db password=***" in logged
    shown = logged + "".join(capsys.readouterr())
    assert not [piece for piece in fragments_of(BrokenStorage.PASSWORD) if piece in shown]


def test_the_health_check_needs_no_credentials_and_says_when_the_journal_cannot_be_read(
    gateway_for: Callable[..., Gateway],
) -> None:
    storage = JournalUnreachable()
    endpoint = Endpoint(f"accounts-{uuid.uuid4().hex[:8]}", storage=storage, journal=True)
    try:
        gateway = gateway_for(endpoint, auth="reader:s3cret")
        healthy = httpx.get(gateway.url + "/healthz")
        assert (healthy.status_code, healthy.json()) == (200, {"status": "ok"})
        storage.down = True
        deadline = time.monotonic() + 10
        while (answer := httpx.get(gateway.url + "/healthz")).status_code == 200:
            assert time.monotonic() < deadline, "the health check never noticed"
            threading.Event().wait(0.05)
        assert answer.status_code == 503
        assert "the journal cannot be read (StorageUnavailable" in answer.json()["reason"]
        assert "connection refused" not in answer.text  # the details are for the log
        assert gateway.counters.unauthorized == 0
    finally:
        endpoint.close()


def test_the_status_names_hosts_and_pids_only_to_an_authenticated_client(
    gateway_for: Callable[..., Gateway],
) -> None:
    def instances(**options: Any) -> list[str]:
        endpoint = Endpoint("reported", storage=MemoryStorage(), journal=True)
        now = datetime.datetime.now(datetime.timezone.utc)
        endpoint.storage.report_status(StatusReport(
            endpoint="reported", instance="db-host-7:4242:a1b2c3", counters={"handled": 3},
            started_at=now, updated_at=now))
        try:
            gateway = gateway_for(endpoint, **options)
            status = httpx.get(gateway.url + "/status", auth=("u", "p")).json()
            return [i["instance"] for i in status["endpoint"]["instances"]]
        finally:
            endpoint.close()

    assert instances() == ["a1b2c3"]  # anybody may read it: no host, no pid
    assert instances(auth="u:p") == ["db-host-7:4242:a1b2c3"]


def test_streams_beyond_max_clients_are_answered_503_while_health_and_status_still_answer(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts, max_clients=2)
    with httpx.Client() as client, stream(client, gateway) as first, \
            stream(client, gateway) as second:
        readers = [events(first), events(second)]  # kept: dropping one hangs up
        assert [next(reader).kind for reader in readers] == ["retry", "retry"]
        refused = client.get(gateway.url + "/", headers=STREAM)
        assert refused.status_code == 503
        assert "at most 2 streams" in refused.json()["error"]
        assert refused.headers["retry-after"] == "5"
        assert client.get(gateway.url + "/healthz").status_code == 200
        assert client.get(gateway.url + "/status").json()["over_capacity"] == 1
    # Once one hangs up, a stream is served again
    assert gateway.counters.wait_until(lambda counters: counters.clients == 0, timeout=10)
    with httpx.Client() as client, stream(client, gateway) as third:
        assert third.status_code == 200


def test_any_origin_may_read_but_never_with_credentials(
    accounts: Endpoint, gateway_for: Callable[..., Gateway],
) -> None:
    gateway = gateway_for(accounts, cors_origins=["*"])
    page = {"Origin": "https://anywhere.example"}
    answer = httpx.get(gateway.url + "/status", headers=page)
    assert answer.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in answer.headers
    preflight = httpx.options(gateway.url + "/", headers={
        **page, "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "last-event-id"})
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in preflight.headers


@pytest.mark.parametrize(("options", "reason"), [
    ({"auth": "reader:"}, "no password"),
    ({"auth": ":s3cret"}, "no user"),
    ({"auth": "reader"}, "no colon"),
    ({"cors_origins": ["*", "https://app.example.com"]}, "give '*' alone"),
    ({"max_clients": 0}, "max_clients must be at least 1"),
])
def test_a_gateway_that_would_be_unsafe_or_useless_is_refused_with_the_reason(
    accounts: Endpoint, options: dict[str, Any], reason: str,
) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(reason)) as refused:
        Gateway(accounts, port=0, **options)
    assert "s3cret" not in str(refused.value)


def test_stopping_ends_every_stream_cleanly_and_releases_the_port(
    accounts: Endpoint,
) -> None:
    gateway = Gateway(accounts, port=0, poll_interval=0.02)
    gateway.start()
    with httpx.Client() as client, stream(client, gateway) as response:
        received = events(response)
        assert next(received).kind == "retry"
        started = time.monotonic()
        gateway.stop(timeout=10)
        assert list(received) == []  # the stream ended: no error, nothing more
    assert time.monotonic() - started < 5
    with socket.socket() as probe:  # the port can be listened on again
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do
        probe.bind(gateway.address)
        probe.listen()
