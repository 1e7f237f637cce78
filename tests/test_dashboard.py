"""The dashboard's pages over HTTP, on memory:// and an in-process storage: what each shows,
that nothing from a message can become markup, and that every change needs the
credentials, the form's token and a confirmation.

Each test runs an endpoint whose handler fails on chosen accounts, without retries, and a
dashboard over a second, never started endpoint of the same name on the same broker and
storage — as ``idembus dashboard`` in another process would see it.
"""

from __future__ import annotations

import datetime
import html
import os
import re
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from idembus import Endpoint, RetryPolicy
from idembus import headers as h
from idembus.dashboard import Dashboard
from idembus.dashboard.security import CSRF_COOKIE
from idembus.envelope import Envelope, format_utc, utc_now
from idembus.runtime.counters import LEDGER, ledger
from idembus.runtime.recoverability.parking import park
from idembus.runtime.recoverability.policy import Recoverability
from idembus.storage.base import SETTLED_FROM_ERROR_QUEUE, AggregateRecord, StatusReport
from idembus.storage.errors import StorageUnavailable
from idembus.storage.memory import MemoryStorage
from idembus.transports.errors import TransportUnavailable
from idembus.transports.kombu import KombuTransport
from tests.support import Deposit, Deposited, SignalCounter
from tests.test_cli_errors import AccountFrozen, FlakyAccounts
from tests.test_status import wait_until

PASSWORD = "s3cret-Pass-9"
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=1">'


@dataclass
class Shop:
    endpoint: Endpoint
    dashboard: Dashboard
    client: httpx.Client
    failing: dict[str, type[Exception]]
    dead_lettered: SignalCounter
    handled: SignalCounter

    def fail(self, account: str, error: type[Exception] = ValueError) -> str:
        """Send a deposit that fails; its id once it is in the error queue."""
        self.failing[account] = error
        waited = self.dead_lettered.count + 1
        message_id = self.endpoint.bus.send(Deposit(account=account, amount=5))
        assert self.dead_lettered.wait_for(waited)
        return message_id

    def form(self, path: str, **query: object) -> tuple[str, dict[str, list[str]]]:
        """The POST form of the page at ``path``: its action and fields."""
        page = self.client.get(path, params=query)
        assert page.status_code == 200, page.text
        action = re.search(r'<form[^>]*method="post" action="([^"]+)"', page.text)
        assert action is not None, page.text
        form = page.text[action.start():page.text.index("</form>", action.start())]
        fields: dict[str, list[str]] = {}
        for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"',
                                      form):
            fields.setdefault(name, []).append(_unescape(value))
        return action.group(1), fields

    def in_error_queue(self) -> list[str]:
        """The ids of the endpoint's failed messages: those the dashboard moved into the
        storage, and those still waiting in the error queue."""
        kept = [parked.envelope.headers.get(h.MESSAGE_ID, "")
                for parked in self.endpoint.storage.parked_messages(self.endpoint.name)
                if parked.source != SETTLED_FROM_ERROR_QUEUE]
        with self.endpoint.transport.inspect(self.endpoint.error_queue) as deliveries:
            return sorted([*kept, *(d.headers.get(h.MESSAGE_ID, "") for d in deliveries)])


def _unescape(value: str) -> str:
    return html.unescape(value)


@pytest.fixture
def shop(unique: str) -> Iterator[Shop]:
    storage = MemoryStorage()
    failing: dict[str, type[Exception]] = {}
    options = {"storage": storage, "journal": True, "error_queue": f"error-{unique}"}
    endpoint = Endpoint(f"shop-{unique}", transport=KombuTransport("memory://"),
                        handlers=[FlakyAccounts(failing, [])], status_interval=0.05,
                        recoverability=Recoverability(
                            retries=RetryPolicy(immediate_retries=0, delayed=())), **options)
    tool = Endpoint(f"shop-{unique}", transport=KombuTransport("memory://"),
                    handlers=[FlakyAccounts({}, [])], **options)
    dashboard = Dashboard([tool], port=0, auth=f"admin:{PASSWORD}", sample_interval=0.05)
    counters = SignalCounter(endpoint, "dead_lettered"), SignalCounter(endpoint, "handled")
    endpoint.start()
    dashboard.start()
    client = httpx.Client(base_url=dashboard.url, auth=("admin", PASSWORD), timeout=15,
                          follow_redirects=False)
    try:
        yield Shop(endpoint, dashboard, client, failing, *counters)
    finally:
        client.close()
        dashboard.stop(5)
        endpoint.close()
        tool.close()


def text_of(page: httpx.Response) -> str:
    """What a person reads: the page without its tags, entities decoded, spaces folded."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page.text)).split())


# -- authentication, CSRF, headers ---------------------------------------------------------


def test_every_page_and_every_post_needs_the_credentials(shop: Shop) -> None:
    anonymous = httpx.Client(base_url=shop.dashboard.url, timeout=10)
    wrong = httpx.Client(base_url=shop.dashboard.url, auth=("admin", "nope"), timeout=10)
    for path in ("/", "/fragment/overview", "/errors", "/aggregates", "/journal",
                 "/static/dashboard.js", "/stream/0/"):
        for client in (anonymous, wrong):
            refused = client.get(path)
            assert refused.status_code == 401, path
            assert refused.headers["www-authenticate"].startswith("Basic")
    # A POST with a valid token and cookie, but no credentials, changes nothing
    message_id = shop.fail("acc-1")
    action, fields = shop.form("/errors/confirm", action="retry", id=message_id)
    cookie = shop.client.cookies.get(CSRF_COOKIE)
    anonymous.cookies.set(CSRF_COOKIE, cookie)
    assert anonymous.post(action, data=fields).status_code == 401
    assert shop.in_error_queue() == [message_id]
    anonymous.close()
    wrong.close()


def test_every_page_forbids_inline_script_and_styles_and_framing(shop: Shop) -> None:
    for path in ("/", "/errors", "/aggregates", "/journal", "/nowhere"):
        page = shop.client.get(path)
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert "frame-ancestors 'none'" in policy and "default-src 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff"
        assert page.headers["cache-control"] == "no-store"
        # and the pages themselves hold no inline script, handler or style
        assert not re.search(r"<script(?![^>]*\bsrc=)", page.text), path
        assert not re.search(r"\son[a-z]+=", page.text), path
        assert " style=" not in page.text, path


def test_a_change_without_the_forms_token_or_from_another_site_is_refused(shop: Shop) -> None:
    message_id = shop.fail("acc-1")
    action, fields = shop.form("/errors/confirm", action="purge", id=message_id)
    # Without the token, with another browser's token, from another origin: refused
    without = {key: value for key, value in fields.items() if key != "csrf_token"}
    assert shop.client.post(action, data=without).status_code == 403
    token = fields["csrf_token"][0]
    forged = {**fields, "csrf_token": [("y" if token[0] == "x" else "x") + token[1:]]}
    assert shop.client.post(action, data=forged).status_code == 403
    other_site = shop.client.post(action, data=fields,
                                  headers={"Origin": "https://evil.example"})
    assert other_site.status_code == 403
    assert "another site" in text_of(other_site)
    fresh = httpx.Client(base_url=shop.dashboard.url, auth=("admin", PASSWORD), timeout=10)
    assert fresh.post(action, data=fields).status_code == 403  # no cookie of its own
    fresh.close()
    assert shop.in_error_queue() == [message_id]
    # With both, from its own page: purged
    done = shop.client.post(action, data=fields)
    assert done.status_code == 303
    assert shop.in_error_queue() == []
    assert "1 message(s) purged" in text_of(shop.client.get(done.headers["location"]))


# -- bad input -----------------------------------------------------------------------------


def hostile_failure(shop: Shop) -> str:
    """A failed message whose id, header name, header value, exception and body hold HTML
    and script, put straight into the error queue; its id."""
    message_id = f"{uuid.uuid4()}{HOSTILE}"
    shop.endpoint.transport.send(Envelope(
        {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: f"test.Deposit{HOSTILE}",
         h.FAILED_QUEUE: shop.endpoint.name, h.EXCEPTION_TYPE: f"builtins.ValueError{HOSTILE}",
         h.EXCEPTION_MESSAGE: f"bad {HOSTILE}", h.STACK_TRACE: f"Traceback {HOSTILE}",
         h.TIME_OF_FAILURE: format_utc(utc_now()), f"x-note{HOSTILE}": f"value {HOSTILE}"},
        f'{{"account": "{HOSTILE.replace(chr(34), chr(39))}", "amount": 1}}',
        shop.endpoint.error_queue))
    return message_id


def assert_shown_as_text(page: httpx.Response) -> None:
    assert page.status_code == 200, page.text
    assert "<script>window.pwned" not in page.text
    assert "<img src=x" not in page.text
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in page.text


def test_html_in_an_id_a_header_name_a_header_value_and_a_body_is_shown_as_text(
    shop: Shop,
) -> None:
    message_id = hostile_failure(shop)
    listed = shop.client.get("/errors")
    assert_shown_as_text(listed)
    shown = shop.client.get("/errors/message", params={"id": message_id})
    assert_shown_as_text(shown)
    text = text_of(shown)
    assert f"x-note{HOSTILE}" in text and f"value {HOSTILE}" in text
    assert f"Traceback {HOSTILE}" in text and f"bad {HOSTILE}" in text
    assert "window.pwned=1</script>" in text  # the body, as text
    assert_shown_as_text(shop.client.get("/errors/confirm",
                                         params={"action": "retry", "id": message_id}))
    # The type filter echoes what was typed, escaped
    assert_shown_as_text(shop.client.get("/errors", params={"type": HOSTILE}))


def test_html_in_an_aggregate_id_is_shown_as_text(shop: Shop) -> None:
    shop.endpoint.bus.send(Deposit(account=HOSTILE, amount=3))
    assert shop.handled.wait_for(1)
    page = shop.client.get("/aggregates", params={"type": "Account", "id": HOSTILE})
    assert_shown_as_text(page)
    assert "live" in text_of(page) and '"balance": 3' in text_of(page)


def test_unknown_endpoints_pages_and_bad_filters_are_told_not_crashed(shop: Shop) -> None:
    assert shop.client.get("/errors", params={"endpoint": "nope"}).status_code == 404
    assert shop.client.get("/nowhere").status_code == 404
    bad_time = shop.client.get("/errors", params={"after": "yesterday<b>"})
    assert bad_time.status_code == 400 and "YYYY-MM-DDTHH:MM" in text_of(bad_time)
    assert "<b>" not in bad_time.text
    assert shop.client.get("/errors/confirm", params={"action": "explode", "all": "1"}
                           ).status_code == 400
    assert shop.client.get("/aggregates", params={"id": "acc-1"}).status_code == 400
    assert shop.client.get("/aggregates", params={"type": "Account", "status": "gone"}
                           ).status_code == 400
    bad_filter = shop.client.get("/journal", params={"types": ",,"})
    assert bad_filter.status_code == 400


# -- the pages -----------------------------------------------------------------------------


def test_a_failed_message_is_retried_after_confirming_and_handled(shop: Shop) -> None:
    # Given a deposit that failed
    message_id = shop.fail("acc-7")
    listed = text_of(shop.client.get("/errors"))
    assert message_id in listed and "builtins.ValueError" in listed
    shown = text_of(shop.client.get("/errors/message", params={"id": message_id}))
    assert "account acc-7 cannot take deposits" in shown and "Traceback" in shown
    # When the confirmation page is opened, nothing changes yet
    action, fields = shop.form("/errors/confirm", action="retry", id=message_id)
    assert shop.in_error_queue() == [message_id]
    # When the cause is gone and the retry is confirmed
    del shop.failing["acc-7"]
    done = shop.client.post(action, data=fields)
    assert done.status_code == 303
    assert "1 message(s) retried" in text_of(shop.client.get(done.headers["location"]))
    # Then it is handled, once, with its id
    assert shop.handled.wait_for(1)
    assert shop.endpoint.storage.load("Account", "acc-7").state == {"balance": 5, "deposits": 1}
    assert shop.in_error_queue() == []


def test_a_selection_or_a_filter_is_retried_or_purged_and_nothing_else(shop: Shop) -> None:
    frozen = [shop.fail(f"frozen-{i}", AccountFrozen) for i in range(2)]
    broken = [shop.fail(f"broken-{i}") for i in range(3)]
    groups = text_of(shop.client.get("/errors"))
    assert "5 failed message(s)" in groups
    # Purge by the exception filter: only the frozen ones go
    action, fields = shop.form("/errors/confirm", action="purge", exception="AccountFrozen")
    assert len(fields["key"]) == 2 and "exception" not in fields  # what is shown, by id
    assert shop.client.post(action, data=fields).status_code == 303
    assert shop.in_error_queue() == sorted(broken)
    # Retry a selection of two: those two come back and fail again (the cause stays)
    action, fields = shop.form("/errors/confirm", action="retry", id=broken[:2])
    assert len(fields["key"]) == 2
    waited = shop.dead_lettered.count + 2
    assert shop.client.post(action, data=fields).status_code == 303
    assert shop.dead_lettered.wait_for(waited)
    assert shop.in_error_queue() == sorted(broken)
    assert not set(frozen) & set(shop.in_error_queue())


def test_the_time_filter_selects_by_time_of_failure(shop: Shop) -> None:
    message_id = shop.fail("acc-1")
    now = utc_now()
    earlier = (now - datetime.timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M")
    later = (now + datetime.timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M")
    assert message_id in shop.client.get("/errors", params={"after": earlier}).text
    assert message_id not in shop.client.get("/errors", params={"after": later}).text
    assert message_id in shop.client.get("/errors", params={"before": later}).text


def test_parked_messages_are_listed_shown_and_retried_with_the_failed(shop: Shop) -> None:
    envelope = Envelope({h.MESSAGE_ID: str(uuid.uuid4()), h.MESSAGE_TYPE: "test.Deposit"},
                        '{"account": "parked-1", "amount": 2}', shop.endpoint.name)
    park(shop.endpoint.storage, endpoint=shop.endpoint.name, source="error-queue",
         envelope=envelope, error=ValueError("too large for the broker"),
         queue=shop.endpoint.name)
    listed = text_of(shop.client.get("/errors"))
    assert "1 failed message(s) (1 parked in the storage)" in listed and "parked" in listed
    assert "too large for the broker" in text_of(
        shop.client.get("/errors/message", params={"id": envelope.message_id}))
    action, fields = shop.form("/errors/confirm", action="retry", id=envelope.message_id)
    assert shop.client.post(action, data=fields).status_code == 303
    assert shop.handled.wait_for(1)
    assert shop.endpoint.storage.parked_messages(shop.endpoint.name) == []


def test_an_aggregate_shows_its_state_version_and_processed_messages(shop: Shop) -> None:
    first = shop.endpoint.bus.send(Deposit(account="acc-9", amount=4))
    second = shop.endpoint.bus.send(Deposit(account="acc-9", amount=6))
    assert shop.handled.wait_for(2)
    page = shop.client.get("/aggregates", params={"type": "Account", "id": "acc-9"})
    text = text_of(page)
    assert '"balance": 10' in text and "version 2" in text and "live" in text
    assert first in text and second in text and "FlakyAccounts" in text
    assert "Deposit" in text  # each processed message's type
    assert shop.client.get("/aggregates", params={"type": "Account", "id": "none"}
                           ).status_code == 404


def test_a_completed_saga_shows_its_tombstone_and_what_it_processed(shop: Shop) -> None:
    storage = shop.endpoint.storage
    storage.commit(AggregateRecord("Order", "o-1"), key="Saga/m-1", state={"step": 1},
                   outgoing=[Envelope({h.MESSAGE_ID: "out-1", h.MESSAGE_TYPE: "t.Shipped"},
                                      "{}", "shipping")])
    storage.commit(storage.load("Order", "o-1"), key="Saga/m-2", state={"step": 2},
                   outgoing=[], completed=True, message_type="t.Cancel")
    text = text_of(shop.client.get("/aggregates", params={"type": "Order", "id": "o-1"}))
    assert "completed (tombstone)" in text and "tombstone" in text
    assert "Last state" in text and '"step": 2' in text
    assert "ended by t.Cancel m-2" in text and "t.Cancel m-2 Saga completed the saga" in text
    assert "m-1" in text and "out-1" in text and "not yet" in text


def test_the_overview_shows_each_instance_and_the_counts_of_the_hour(shop: Shop) -> None:
    for account in ("a", "b", "c"):
        shop.endpoint.bus.send(Deposit(account=account, amount=1))
    assert shop.handled.wait_for(3)
    shop.fail("d")
    # Reports are written on a timer: read until one says what the endpoint counted
    assert wait_until(lambda: any(
        r.counters.get("dead_lettered") == 1 and r.counters.get("handled") == 3
        for r in shop.endpoint.storage.status_reports(shop.endpoint.name)))
    shop.dashboard.sample()
    page = shop.client.get("/fragment/overview")
    assert re.search(r'data-counter="handled">3<', page.text)
    assert re.search(r'data-counter="dead_lettered">1<', page.text)
    text = text_of(page)
    assert "1 running" in text and socket.gethostname() in text  # authenticated: host shown
    assert re.search(r'data-counter="error_queue">1<', page.text)
    # the whole page refreshes that part in place, through the shipped script
    assert 'data-refresh="/fragment/overview"' in shop.client.get("/").text


def test_the_overview_shows_a_ledger_that_adds_up_and_the_queue_depth_and_lag(shop: Shop) -> None:
    # Given deposits handled, one delivered twice more, and one that fails
    shop.endpoint.bus.send(Deposit(account="l-1", amount=1))
    for _ in range(3):
        shop.endpoint.bus.send(Deposit(account="l-2", amount=1), message_id="again")
    assert shop.handled.wait_for(2)
    shop.fail("l-3")
    assert wait_until(lambda: any(
        r.counters.get("settled") == 5 for r in shop.endpoint.storage.status_reports(
            shop.endpoint.name)))
    [report] = shop.endpoint.storage.status_reports(shop.endpoint.name)

    # When the overview is drawn
    shop.dashboard.sample()
    response = shop.client.get("/fragment/overview")
    page = response.text

    # Then the total row is the report's ledger, and its terms add up to received
    totals = {key: int(value) for key, value in re.findall(r'data-total="(\w+)">(\d+)<', page)}
    assert totals == ledger(report.counters)
    assert totals["received"] == 5 == sum(totals[term] for term in LEDGER)
    assert (totals["handled"], totals["duplicate"], totals["dead_lettered"]) == (2, 2, 1)
    # each term is named and explained, and the signal counters are all there too
    text = text_of(response)
    assert "received = handled + duplicate + dropped + retrying" in text
    assert all(meaning in html.unescape(page) for meaning in LEDGER.values())
    assert 'data-signal="redispatched"' in page and 'data-signal="outside_window"' in page
    # the queue as memory:// tells it (ready only: "–" for the rest), and the lag
    assert re.search(r'data-counter="queue_ready">0<', page)
    assert re.search(r'data-counter="queue_consumers">–<', page)
    assert re.search(r'data-counter="lag">\d+(\.\d)? (ms|s)<', page)


def test_on_loopback_without_credentials_host_and_pid_are_shown_and_only_loopback_names_answer(
    unique: str,
) -> None:
    # Given a dashboard on 127.0.0.1 without credentials: only this machine's users see it
    storage = MemoryStorage()
    with Endpoint(f"plain-{unique}", storage=storage, status_interval=2) as endpoint:
        assert wait_until(lambda: storage.status_reports(endpoint.name))
        dashboard = Dashboard([endpoint], port=0)
        dashboard.start()
        try:
            dashboard.sample()
            page = httpx.get(f"{dashboard.url}/", timeout=10)
            rebound = httpx.get(f"{dashboard.url}/errors", timeout=10,
                                headers={"Host": f"rebound.example:{dashboard.address[1]}"})
        finally:
            dashboard.stop(5)
    # Then the instance is named with its host and pid, as with credentials
    assert page.status_code == 200
    assert f"{socket.gethostname()}:{os.getpid()}:" in text_of(page)
    # and, without credentials, a page of another site resolved to 127.0.0.1 gets nothing
    assert rebound.status_code == 400 and "rebound" not in rebound.text


def test_beyond_loopback_without_credentials_no_host_or_pid_is_shown(unique: str) -> None:
    storage = MemoryStorage()
    # (reports every 2 s: a loaded machine answering in a second does not see it "lost")
    with Endpoint(f"open-{unique}", storage=storage, status_interval=2) as endpoint:
        assert wait_until(lambda: storage.status_reports(endpoint.name))
        dashboard = Dashboard([endpoint], host="0.0.0.0", port=0)
        dashboard.start()
        try:
            dashboard.sample()
            page = httpx.get(f"http://127.0.0.1:{dashboard.address[1]}/", timeout=10)
        finally:
            dashboard.stop(5)
    assert page.status_code == 200 and "1 running" in text_of(page)
    assert socket.gethostname() not in page.text


def test_stopped_instances_collapse_after_a_while_and_a_silent_one_is_marked_lost(
    unique: str,
) -> None:
    # Given an endpoint's three processes: one running, one that stopped, one that went
    # silent without saying it stopped (killed)
    storage = MemoryStorage()
    name = f"fleet-{unique}"
    now = utc_now()
    storage.report_status(StatusReport(name, "host:1:aa", counters={}, started_at=now,
                                       updated_at=now, stopped=False))
    storage.report_status(StatusReport(name, "host:2:bb", counters={}, started_at=now,
                                       updated_at=now - datetime.timedelta(minutes=2),
                                       stopped=True))
    storage.report_status(StatusReport(name, "host:3:cc", counters={}, started_at=now,
                                       updated_at=now - datetime.timedelta(minutes=2),
                                       stopped=False))
    endpoint = Endpoint(name, storage=storage, status_interval=5.0)
    shown = {}
    try:
        for after in (300.0, 60.0):
            dashboard = Dashboard([endpoint], port=0, stopped_shown_for=after)
            dashboard.sample()
            shown[after] = text_of_markup(dashboard)
    finally:
        endpoint.close()
    # Then within five minutes the stopped one is listed; after one minute it is counted
    assert "host:2:bb" in shown[300.0] and "not listed" not in shown[300.0]
    assert "host:2:bb" not in shown[60.0]
    assert "1 instance(s) stopped more than 1 minute(s) ago not listed" in shown[60.0]
    assert "1 stopped" in shown[60.0]
    # and the silent one is marked lost, the running one running
    assert "host:3:cc lost" in shown[60.0] and "host:1:aa running" in shown[60.0]
    assert "1 lost" in shown[60.0]


def text_of_markup(dashboard: Dashboard) -> str:
    from idembus.dashboard.overview import overview

    markup = str(overview(dashboard, utc_now()))
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", markup)).split())


def test_the_confirmation_page_puts_the_confirmed_action_first_and_nothing_else(
    shop: Shop,
) -> None:
    # Given one failed message
    failed_id = shop.fail("d")
    # When the operator asks to retry it
    page = shop.client.get("/errors/confirm", params={"action": "retry", "id": failed_id})
    assert page.status_code == 200
    # Then the first button of the page is the one that does what is confirmed, and the
    # listing under it has no other action to press
    buttons = re.findall(r"<button[^>]*>([^<]*)</button>", page.text)
    assert buttons == ["Yes, retry 1 message(s)"]
    assert 'type="checkbox"' not in page.text


def test_the_pages_have_an_icon_that_is_served(shop: Shop) -> None:
    page = shop.client.get("/")
    icon = re.search(r'<link rel="icon" href="([^"]+)"', page.text)
    assert icon is not None
    served = shop.client.get(icon.group(1))
    assert served.status_code == 200 and served.text.startswith("<svg")


def test_the_live_page_shows_recent_events_and_follows_the_gateways_stream(shop: Shop) -> None:
    # An empty journal: the stream starts from the time it was read (0 would replicate)
    empty = re.search(r'data-stream="([^"]+)"', shop.client.get("/journal").text)
    assert empty is not None and re.search(r"last_event_id=\d{13}", empty.group(1))
    shop.endpoint.bus.publish(Deposited(account="j-1", amount=1))
    # (an event is journaled once the broker confirmed it)
    assert wait_until(lambda: shop.endpoint.storage.journal_bounds().newest >= 1)
    page = shop.client.get("/journal")
    assert "j-1" in text_of(page)
    # the script follows the gateway's own stream after the newest entry shown
    source = re.search(r'data-stream="([^"]+)"', page.text)
    assert source is not None
    start = _unescape(source.group(1))
    assert start.startswith("/stream/0/?") and "last_event_id=1" in start
    shop.endpoint.bus.publish(Deposited(account="j-2", amount=2))
    events = []
    with shop.client.stream("GET", start, headers={"Accept": "text/event-stream"}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                break
    assert len(events) == 1 and '"j-2"' in events[0]  # j-1 not again, j-2 live
    filtered = shop.client.get("/journal", params={"types": "nothing.Like.This"})
    assert filtered.status_code == 200 and "j-1" not in text_of(filtered)


def test_with_the_broker_down_the_failed_messages_kept_are_shown_and_the_outage_said(
    shop: Shop, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given one failed message the dashboard has moved into the storage, and one more still
    # in the error queue
    kept = shop.fail("acc-1")
    assert kept in text_of(shop.client.get("/errors"))
    waiting = shop.fail("acc-2")
    # When the broker cannot be reached
    (tool,) = shop.dashboard.endpoints.values()

    def unreachable(queue: str) -> int:
        raise TransportUnavailable(f"cannot connect to amqp://shop:{PASSWORD}@broker//")

    monkeypatch.setattr(tool.transport, "pending", unreachable)
    listed, shown = shop.client.get("/errors"), shop.client.get("/errors/message",
                                                                 params={"id": kept})
    # Then the kept one is listed and shown, the page says the queue could not be read, and
    # the other waits for the broker
    assert listed.status_code == 200 and shown.status_code == 200
    assert kept in text_of(listed) and waiting not in text_of(listed)
    for page in (listed, shown):
        assert "The broker cannot be reached" in text_of(page)
        assert PASSWORD not in page.text
    monkeypatch.undo()
    assert waiting in text_of(shop.client.get("/errors"))


class Unreachable(MemoryStorage):
    """A storage whose status reports and parked messages cannot be read, with a password
    in the reason (as a driver's error may name its URL)."""

    process_local = False

    def status_reports(self, endpoint: str) -> list[Any]:
        raise StorageUnavailable(f"cannot connect to postgresql://shop:{PASSWORD}@db:5432/x")

    def parked_messages(self, endpoint: str) -> list[Any]:
        raise StorageUnavailable(f"cannot connect to postgresql://shop:{PASSWORD}@db:5432/x")

    def parked_page(self, endpoint: str | None, **_: Any) -> list[Any]:
        raise StorageUnavailable(f"cannot connect to postgresql://shop:{PASSWORD}@db:5432/x")


def test_a_storage_that_cannot_be_read_is_said_on_the_page_without_its_password(
    unique: str,
) -> None:
    with Endpoint(f"down-{unique}", storage=Unreachable()) as endpoint:
        dashboard = Dashboard([endpoint], port=0, auth=f"admin:{PASSWORD}")
        dashboard.start()
        try:
            client = httpx.Client(base_url=dashboard.url, auth=("admin", PASSWORD), timeout=10)
            overview, errors = client.get("/"), client.get("/errors")
            client.close()
        finally:
            dashboard.stop(5)
    assert "status reports cannot be read: cannot connect to postgresql://shop:***@db" in \
        text_of(overview)
    assert errors.status_code == 503 and "cannot be read now" in text_of(errors)
    for page in (overview, errors):
        assert PASSWORD not in page.text


def test_a_claim_checked_failure_shows_what_its_references_name(shop: Shop) -> None:
    # Given two claim-checked messages in the error queue: one whose body the payload
    # store keeps, one whose body it does not
    storage = shop.endpoint.storage
    assert isinstance(storage, MemoryStorage)
    body = '{"account": "acc-big", "amount": 5, "note": "' + "n" * 3000 + '"}'
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    storage.put_payload(f"payload-{ids[0]}", body.encode(),
                        keep_until=utc_now() + datetime.timedelta(days=1))
    for message_id in ids:
        shop.endpoint.transport.send(Envelope(
            {h.MESSAGE_ID: message_id, h.MESSAGE_TYPE: "test.Deposit",
             h.FAILED_QUEUE: shop.endpoint.name, h.EXCEPTION_TYPE: "builtins.ValueError",
             h.TIME_OF_FAILURE: format_utc(utc_now()), h.CLAIM_CHECK: f"payload-{message_id}",
             h.CLAIM_CHECK_BYTES: str(len(body))},
            f'{{"{h.CLAIM_CHECK}": "payload-{message_id}", "bytes": {len(body)}}}',
            shop.endpoint.error_queue))
    # When each is shown
    found = text_of(shop.client.get("/errors/message", params={"id": ids[0]}))
    missing = text_of(shop.client.get("/errors/message", params={"id": ids[1]}))
    # Then the first shows the body's size and start, the second why it cannot be read
    assert f"Claim-checked body the first 2000 characters payload id payload-{ids[0]}" in found
    assert f"found yes bytes {len(body)}" in found and body[:2000] in found
    assert body[:2001] not in found
    assert "found no" in missing and "cannot be read" in missing
    assert "is not in the payload store" in missing
