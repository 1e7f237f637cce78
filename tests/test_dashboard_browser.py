"""The dashboard in a real browser: Playwright drives Debian's Chromium (headless, kept off
the network) through every page of ``idembus dashboard``, served in its own process, for an
order endpoint running here on RabbitMQ and PostgreSQL with traffic and failures.

What a person would see is checked against the storage and the broker: the instance's
counters and the hour's totals against its status report, the failed messages against the
error queue, a saga's tombstone against its row; a failed message is retried through the
pages and handled; a message carrying script runs none. Each page is saved as a PNG (in
``$IDEMBUS_SCREENSHOTS`` if set — ``make screenshots`` sets docs/screenshots — else in a
temporary directory).

Locally the module skips when Chromium or Playwright is missing (and the services, as
everywhere); under CI=true it fails instead (``.ci/run`` installs Chromium).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import queue
import re
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest

from idembus import Endpoint
from idembus import headers as h
from idembus.envelope import Envelope, format_utc, utc_now
from idembus.runtime.counters import LEDGER, ledger
from idembus.runtime.recoverability import error_queue
from idembus.storage.postgres import PostgresStorage
from idembus.transports.kombu import KombuTransport
from tests.conftest import AMQP_URL, IN_CI, POSTGRES_URL, require_service
from tests.dashboard_app import PayOrder, PlaceOrder, endpoint
from tests.support import SignalCounter
from tests.test_status import wait_until

#: A soak (make soak): Chromium walks the pages for a minute or more, and a test waits for
#: the module's app and browser to start.
pytestmark = [pytest.mark.amqp, pytest.mark.postgres, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
#: Chromium's flags that keep it headless and off the network (no background requests).
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
USER, PASSWORD = "operator", "dash-Board-pw-7"
#: Milliseconds Playwright waits for what a page should come to show.
PATIENCE = 20_000
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=1">'


def require_browser() -> Any:
    """Playwright's sync API, if it and Debian's Chromium are here: skip (locally) or fail
    (under CI=true) otherwise."""
    problem = None
    if not os.path.exists(CHROMIUM):
        problem = f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
    try:
        from playwright import sync_api
    except ImportError as error:
        problem = problem or f"playwright is not installed ({error}); make test installs it"
    if problem is not None:
        if IN_CI:
            pytest.fail(f"{problem}; under CI=true the browser tests must run")
        pytest.skip(problem)
    return sync_api


@dataclass
class Shop:
    endpoint: Endpoint
    declined: set[str]
    url: str
    placed: list[str]
    failed: list[str]
    completed: list[str]
    handled: SignalCounter
    dead_lettered: SignalCounter
    screenshots: pathlib.Path

    @property
    def storage(self) -> PostgresStorage:
        storage: PostgresStorage = self.endpoint.storage  # type: ignore[assignment]
        return storage

    def report(self) -> dict[str, int]:
        [report] = self.storage.status_reports(self.endpoint.name)
        return dict(report.counters)


class Dashboard(contextlib.AbstractContextManager["Dashboard"]):
    """``idembus dashboard tests.dashboard_app:endpoint`` in a process of its own."""

    def __init__(self, environment: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "idembus", "dashboard", "tests.dashboard_app:endpoint",
             "--listen", "127.0.0.1:0", "--sample-interval", "0.5", "--refresh", "1"],
            cwd=ROOT, env=environment, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.output.append(line)
                lines.put(line)
            lines.put("")

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        while True:
            line = lines.get(timeout=60)
            found = re.search(r"idembus dashboard: .* on (http://\S+)", line)
            if found:
                self.url = found.group(1)
                return
            if not line:
                raise AssertionError("the dashboard did not start:\n" + "".join(self.output))

    def __exit__(self, *exc_info: object) -> None:
        self.process.terminate()
        self.process.wait(30)
        self._reader.join(10)
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    require_browser()
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    suffix = uuid.uuid4().hex[:8]
    environment = {"APP_NAME": f"shop-{suffix}", "APP_ERROR_QUEUE": f"shop-error-{suffix}",
                   "APP_EXCHANGE": f"shop-events-{suffix}", "APP_PREFIX": f"dash{suffix}",
                   "IDEMBUS_AMQP_URL": AMQP_URL, "IDEMBUS_POSTGRES_URL": POSTGRES_URL,
                   "IDEMBUS_GATEWAY_AUTH": f"{USER}:{PASSWORD}", "PYTHONPATH": str(ROOT)}
    shots = os.environ.get("IDEMBUS_SCREENSHOTS")
    screenshots = (ROOT / shots if shots else tmp_path_factory.mktemp("screenshots"))
    screenshots.mkdir(parents=True, exist_ok=True)
    declined: set[str] = set()
    with mock.patch.dict(os.environ, environment):
        running = endpoint(declined, status_interval=0.5)
        running.storage.migrate()
        transport = KombuTransport(AMQP_URL, exchange=environment["APP_EXCHANGE"])
        try:
            # The dashboard first: everything the endpoint then does falls in its hour
            with Dashboard({**os.environ}) as dashboard:
                handled = SignalCounter(running, "handled")
                dead = SignalCounter(running, "dead_lettered")
                running.start()
                shop = Shop(running, declined, dashboard.url, [], [], [], handled, dead,
                            screenshots)
                traffic(shop)
                yield shop
        finally:
            running.close()
            for name in (environment["APP_NAME"], environment["APP_ERROR_QUEUE"]):
                transport.delete_queue(name)
            transport.delete_exchange()
            transport.close()
            cleaner = PostgresStorage(POSTGRES_URL, table_prefix=environment["APP_PREFIX"])
            cleaner.drop_tables()
            cleaner.close()


def traffic(shop: Shop) -> None:
    """Orders placed (three declined), two of them sent twice, three paid (completed)."""
    bus = shop.endpoint.bus
    shop.declined.update({"c3-1003", "c5-1005", "c7-1007"})
    for number in range(1000, 1024):
        order_id = f"c{number % 10}-{number}"
        message_id = bus.send(PlaceOrder(order_id=order_id, amount=number % 97 + 3))
        (shop.failed if order_id in shop.declined else shop.placed).append(order_id)
        if number in (1001, 1002):
            bus.send(PlaceOrder(order_id=order_id, amount=number % 97 + 3),
                     message_id=message_id)  # a duplicate
    assert shop.dead_lettered.wait_for(3, timeout=60)
    assert shop.handled.wait_for(len(shop.placed), timeout=60)
    for order_id in shop.placed[:3]:
        bus.send(PayOrder(order_id=order_id))
        shop.completed.append(order_id)
    assert shop.handled.wait_for(len(shop.placed) + 3, timeout=60)
    # a failed message whose body and headers carry script
    shop.endpoint.transport.send(Envelope(
        {h.MESSAGE_ID: f"{uuid.uuid4()}", h.MESSAGE_TYPE: "shop.PlaceOrder",
         h.FAILED_QUEUE: shop.endpoint.name, h.EXCEPTION_TYPE: "tests.Hostile",
         h.EXCEPTION_MESSAGE: f"hostile {HOSTILE}", h.TIME_OF_FAILURE: format_utc(utc_now()),
         f"x-note{HOSTILE}": HOSTILE},
        '{"order_id": "' + HOSTILE.replace('"', "'") + '", "amount": 1}',
        shop.endpoint.error_queue))


@pytest.fixture(scope="module")
def browser(shop: Shop) -> Iterator[Any]:
    sync_api = require_browser()
    with sync_api.sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            http_credentials={"username": USER, "password": PASSWORD},
            viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(PATIENCE)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser: Any, shop: Shop) -> Iterator[Any]:
    opened = browser.new_page()
    errors: list[str] = []
    missing: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.on("response", lambda response: missing.append(response.url)
              if response.status == 404 and ("favicon" in response.url
                                              or "/static/" in response.url) else None)
    yield opened
    opened.close()
    assert errors == []  # the shipped script ran without an error
    assert missing == []  # nor did the page ask for an icon or a file it does not have


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as playwright_expect
    return playwright_expect(locator)


def test_the_overview_shows_the_instance_and_counts_that_match_its_status_report(
    page: Any, shop: Shop,
) -> None:
    # Given the endpoint's last report once everything settled
    assert wait_until(lambda: shop.report().get("dead_lettered") == 3
                      and shop.report().get("handled") == shop.handled.count, timeout=30)
    counters = shop.report()
    # When a person opens the overview
    page.goto(shop.url + "/")
    section = page.locator(f'section[data-endpoint="{shop.endpoint.name}"]')
    instance = section.locator("table.instances tbody tr").first
    # Then the instance runs, named with its host and pid (authenticated), and its counters
    # and the hour's totals are the report's (it started after the dashboard)
    expect(instance.locator(".state")).to_have_text("running")
    expect(instance.locator("code")).to_contain_text(f":{os.getpid()}:")
    figures = ledger(counters)  # the instance row shows the ledger, adding up to received
    assert figures["received"] == sum(figures[term] for term in LEDGER)
    for counter in ("received", "handled", "duplicate", "dead_lettered"):
        expect(instance.locator(f'[data-counter="{counter}"]')).to_have_text(
            str(figures[counter]))
        expect(section.locator(f'.tiles [data-counter="{counter}"]')).to_have_text(
            f"{counters[counter]:,}")
    assert counters["duplicate"] == 2 and counters["dead_lettered"] == 3
    expect(section.locator('[data-counter="error_queue"]')).to_have_text(
        str(shop.endpoint.transport.pending(shop.endpoint.error_queue)))
    assert section.locator("svg.chart rect.bar").count() > 0
    # And the page refreshes itself: new traffic shows without a reload
    before = shop.handled.count
    shop.endpoint.bus.send(PlaceOrder(order_id="c9-2001", amount=9))
    assert shop.handled.wait_for(before + 1)
    shop.placed.append("c9-2001")
    expect(instance.locator('[data-counter="handled"]')).to_have_text(str(before + 1))
    page.screenshot(path=str(shop.screenshots / "overview.png"), full_page=True)


def test_the_failed_messages_show_the_exception_and_script_in_them_runs_nothing(
    page: Any, shop: Shop,
) -> None:
    page.goto(shop.url + "/errors")
    rows = page.locator("table.failed tbody tr")
    expect(rows).to_have_count(4)  # three declined cards, one hostile message
    # Looking moved them out of the error queue into the storage, where they stay
    assert shop.endpoint.transport.pending(shop.endpoint.error_queue) == 0
    assert len(list(error_queue.stored(shop.endpoint))) == 4
    expect(page.locator("table.failed")).to_contain_text("CardDeclined")
    expect(page.locator("table.failed")).to_contain_text("card declined for order c3-1003")
    expect(page.locator("table.failed")).to_contain_text(HOSTILE)  # as text
    page.screenshot(path=str(shop.screenshots / "failed-messages.png"), full_page=True)
    # Filter by exception: the three declined cards
    page.fill('input[name="exception"]', "CardDeclined")
    page.click('form.filters button[type="submit"]')
    expect(rows).to_have_count(3)
    # The hostile message's page shows its script as text and runs none of it
    page.goto(shop.url + "/errors?exception=tests.Hostile")
    page.locator("table.failed tbody tr a").first.click()
    expect(page.locator("table.headers")).to_contain_text(f"x-note{HOSTILE}")
    expect(page.locator("pre.code").last).to_contain_text("<script>window.pwned=1</script>")
    assert page.evaluate("window.pwned") is None
    assert page.locator("img[src=x]").count() == 0


def test_a_failed_message_is_retried_through_the_pages_and_handled(
    page: Any, shop: Shop,
) -> None:
    # Given the card of c3-1003 now goes through
    shop.declined.discard("c3-1003")
    page.goto(shop.url + "/errors?exception=CardDeclined")
    page.get_by_role("link", name=re.compile(r"^[0-9a-f-]{36}$")).first.click()
    expect(page.locator("table.pairs")).to_contain_text("CardDeclined")
    if "c3-1003" not in page.locator("article.copy").inner_text():
        page.goto(shop.url + "/errors?exception=CardDeclined")
        page.locator("table.failed tbody tr", has_text="c3-1003").locator("a").click()
    expect(page.locator(".exception-message")).to_contain_text("c3-1003")
    expect(page.locator("pre.trace")).to_contain_text("CardDeclined")
    page.screenshot(path=str(shop.screenshots / "failed-message.png"), full_page=True)
    # When the operator asks to retry it, is asked to confirm, and confirms
    page.click('button[value="retry"]')
    expect(page.locator("p.question")).to_contain_text("Retry 1 message(s)")
    expect(page.locator("main button, body button").first).to_have_attribute("id", "confirm")
    assert page.locator("button").count() == 1
    page.screenshot(path=str(shop.screenshots / "confirm-retry.png"), full_page=True)
    before = shop.handled.count
    page.click("#confirm")
    # Then the list says so, and the order is handled and stored
    expect(page.locator(".notice.ok")).to_contain_text("1 message(s) retried")
    assert shop.handled.wait_for(before + 1, timeout=30)
    assert shop.storage.load("Order", "c3-1003").state == {"amount": 1003 % 97 + 3, "note": ""}
    expect(page.locator("table.failed tbody tr")).to_have_count(3)


def test_a_saga_is_looked_up_and_a_completed_one_shows_its_tombstone(
    page: Any, shop: Shop,
) -> None:
    live = shop.placed[5]
    page.goto(shop.url + "/aggregates")
    page.fill('input[name="type"]', "Order")
    page.fill('input[name="id"]', live)
    page.click('form.filters button[type="submit"]')
    record = shop.storage.load("Order", live)
    expect(page.get_by_role("row", name=f"version {record.version}", exact=True)).to_be_visible()
    expect(page.locator("pre.code")).to_contain_text(f'"amount": {record.state["amount"]}')
    # its processed message, with the id of the event it published, dispatched
    entries = page.locator("table.entries tbody tr")
    expect(entries).to_have_count(1)
    expect(entries.first).to_contain_text("yes")
    done = shop.completed[0]
    page.goto(f"{shop.url}/aggregates?type=Order&id={done}")
    expect(page.locator(".notice.tombstone")).to_contain_text("tombstone")
    expect(page.get_by_role("row", name="status completed (tombstone)")).to_be_visible()
    expect(page.locator("table.entries tbody tr")).to_have_count(2)  # placed and paid
    page.screenshot(path=str(shop.screenshots / "saga.png"), full_page=True)


def test_the_live_stream_shows_events_as_they_are_journaled_with_the_filters(
    page: Any, shop: Shop,
) -> None:
    page.goto(shop.url + "/journal?parents=customer/c4")
    journal = page.locator("table#journal tbody")
    expect(page.locator("#stream-state")).to_have_text("live")
    shown = journal.locator("tr").count()
    assert shown == sum(order.startswith("c4-") for order in shop.placed)
    # When two orders are placed, one of the filtered customer's
    shop.endpoint.bus.send(PlaceOrder(order_id="c8-3001", amount=5))
    shop.endpoint.bus.send(PlaceOrder(order_id="c4-3002", amount=5))
    # Then that one appears without a reload, and the other does not
    expect(journal.locator("tr").first).to_contain_text("c4-3002")
    expect(journal.locator("tr")).to_have_count(shown + 1)
    assert "c8-3001" not in journal.inner_text()
    page.goto(shop.url + "/journal")
    expect(page.locator("table#journal")).to_contain_text("c8-3001")
    page.screenshot(path=str(shop.screenshots / "live-stream.png"), full_page=True)
