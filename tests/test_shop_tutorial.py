"""The tutorial's shop (samples/shop, docs/tutorial): its Scenario tests on memory://, the
sample files the pages show, and the whole system end to end on RabbitMQ and PostgreSQL —
three services as ``idembus run ... --workers 2`` and the storefront under uvicorn, a worker
killed with SIGKILL mid-way, one order in the error queue and retried from the CLI."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import AMQP_URL, POSTGRES_URL, require_service

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHOP = ROOT / "samples" / "shop"
TUTORIAL = ROOT / "docs" / "tutorial"
SERVICES = ("orders", "payments", "shipping")
QUEUES = (*SERVICES, "storefront", "shop-errors")



@pytest.fixture(autouse=True)
def shop_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shop importable as `pip install -e samples/shop` makes it (CI does not install it)."""
    monkeypatch.syspath_prepend(str(SHOP))


def python_blocks(page: pathlib.Path) -> list[tuple[bool, str]]:
    """The ```python blocks of a page, each with whether it is marked ``<!-- fragment -->``."""
    blocks = []
    pattern = re.compile(r"(<!-- fragment -->\s*\n)?```python\n(.*?)```", re.S)
    for match in pattern.finditer(page.read_text()):
        blocks.append((match.group(1) is not None, match.group(2)))
    return blocks


# --- the pages -------------------------------------------------------------------------


def test_the_pages_show_the_sample_files_as_they_are() -> None:
    """A fragment whose first line names a sample file (``# samples/shop/shop/x.py``) is
    that file, whole: the tutorial cannot drift from the code the end-to-end test runs."""
    shown = 0
    for page in sorted(TUTORIAL.glob("*.md")):
        for fragment, code in python_blocks(page):
            first = code.splitlines()[0] if code else ""
            if fragment and first.startswith("# samples/shop/"):
                path = ROOT / first[2:].strip()
                body = code.split("\n", 1)[1]
                assert body == path.read_text(), f"{page.name} shows an old {path.name}"
                shown += 1
    assert shown >= 6


def test_every_block_of_the_tutorial_runs() -> None:
    """Runnable blocks run (on memory://), in page order; fragments compile."""
    ran = 0
    for page in sorted(TUTORIAL.glob("*.md")):
        namespace: dict[str, Any] = {"__name__": f"tutorial_{page.stem}"}
        for fragment, code in python_blocks(page):
            compiled = compile(code, str(page), "exec")
            if not fragment:
                exec(compiled, namespace)  # noqa: S102 - the page's own code
                ran += 1
    assert ran >= 1


# --- virtual time ----------------------------------------------------------------------


def test_an_unpaid_order_is_cancelled_when_the_payment_times_out() -> None:
    from shop.messages import ChargePayment, OrderCancelled, PlaceOrder
    from shop.orders import ROUTES, Order, OrderSaga

    from idembus.testing import Scenario

    scenario = Scenario(handlers=[OrderSaga()], routes=ROUTES)
    scenario.send(PlaceOrder(order_id="o-1", customer="ada", card_number="4242424242424242",
                             amount_cents=1250))
    assert scenario.sent[0] == ChargePayment(order_id="o-1", card_number="4242424242424242",
                                             amount_cents=1250)
    scenario.advance(minutes=14)
    assert scenario.state(Order, "o-1").status == "awaiting_payment"
    scenario.advance(minutes=2)
    assert scenario.published == [OrderCancelled(order_id="o-1", reason="no payment in time")]
    assert scenario.completed(Order, "o-1")


def test_a_paid_order_is_shipped_and_its_timeout_dropped(tmp_path: pathlib.Path) -> None:
    from shop.messages import OrderCompleted, PaymentFailed, PlaceOrder
    from shop.orders import ROUTES, Order, OrderSaga
    from shop.payments import PaymentHandler
    from shop.provider import BLOCKED_CARD, DECLINED_CARD, FakePaymentProvider
    from shop.shipping import Shipment, ShipmentHandler

    from idembus.testing import Scenario

    provider = FakePaymentProvider(str(tmp_path / "provider.sqlite3"))
    scenario = Scenario(handlers=[OrderSaga()], routes=ROUTES, endpoint="orders")
    scenario.add_endpoint("payments", handlers=[PaymentHandler(provider)])
    scenario.add_endpoint("shipping", handlers=[ShipmentHandler])
    for order_id, card in (("paid", "4242424242424242"), ("declined", DECLINED_CARD),
                           ("blocked", BLOCKED_CARD)):
        scenario.send(PlaceOrder(order_id=order_id, customer="ada", card_number=card,
                                 amount_cents=1250))
    assert OrderCompleted(order_id="paid") in scenario.published
    assert scenario.state(Shipment, "paid", endpoint="shipping").parcels == 1
    assert any(isinstance(m, PaymentFailed) and m.order_id == "declined"
               for m in scenario.published)
    assert [e.message.order_id for e in scenario.errors] == ["blocked"]
    assert scenario.errors[0].exception_type == "shop.provider.CardBlocked"
    assert scenario.errors[0].attempts == (1, 0)  # unrecoverable: no retry could help
    assert [c.description for c in provider.charges()] == ["order paid"]
    scenario.advance(minutes=16)
    assert scenario.endpoint("orders").counters["timeout_dropped"] == 2  # paid, declined
    assert scenario.completed(Order, "blocked")  # cancelled: no payment in time


def test_the_provider_charges_once_per_idempotency_key(tmp_path: pathlib.Path) -> None:
    from shop.provider import BLOCKED_CARD, CardBlocked, FakePaymentProvider

    provider = FakePaymentProvider(str(tmp_path / "provider.sqlite3"))
    first = provider.charge("4242424242424242", 100, description="a", idempotency_key="k")
    again = provider.charge("4242424242424242", 100, description="a", idempotency_key="k")
    assert again.charge_id == first.charge_id
    assert [(c.charge_id, c.requests) for c in provider.charges()] == [(first.charge_id, 2)]
    with pytest.raises(CardBlocked):
        provider.charge(BLOCKED_CARD, 100, description="b", idempotency_key="k2")
    provider.approve(BLOCKED_CARD)
    assert provider.charge(BLOCKED_CARD, 100, description="b", idempotency_key="k2").charge_id


# --- end to end on RabbitMQ and PostgreSQL ---------------------------------------------


@dataclass
class Shop:
    """The running system: supervisors, the storefront, and how to reach them."""

    environment: dict[str, str]
    base_url: str
    processes: dict[str, subprocess.Popen[bytes]]

    def cli(self, *arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *arguments], env=self.environment, cwd=SHOP,
                              capture_output=True, text=True, timeout=60)

    def workers(self, service: str) -> list[int]:
        """The pids of the worker processes a service's supervisor runs now."""
        pid = self.processes[service].pid
        try:
            children = pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return []
        return [int(child) for child in children.split()]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.2)


def clean_slate() -> None:
    """No queue or table of an earlier run: every order this test counts is its own."""
    from idembus.storage.postgres import PostgresStorage
    from idembus.transports.kombu import KombuTransport

    transport = KombuTransport(AMQP_URL)
    try:
        for queue in QUEUES:
            transport.delete_queue(queue)
    finally:
        transport.close()
    for prefix in (*SERVICES, "storefront"):
        storage = PostgresStorage(POSTGRES_URL, table_prefix=prefix)
        try:
            storage.drop_tables()
        finally:
            storage.close()


def consumers(queue: str) -> int:
    import kombu

    with kombu.Connection(AMQP_URL) as connection:
        try:
            return int(connection.default_channel.queue_declare(
                queue=queue, passive=True).consumer_count)
        except connection.channel_errors:
            return 0


def answers(url: str) -> bool:
    """Whether the storefront answers at ``url`` (any status)."""
    try:
        httpx.get(url, timeout=2)
    except httpx.TransportError:
        return False
    return True


def queue_exists(queue: str) -> bool:
    import kombu

    with kombu.Connection(AMQP_URL) as connection:
        try:
            connection.default_channel.queue_declare(queue=queue, passive=True)
        except connection.channel_errors:
            return False
    return True


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def shop(tmp_path: pathlib.Path) -> Iterator[Shop]:
    require_service(AMQP_URL, "RabbitMQ")
    require_service(POSTGRES_URL, "PostgreSQL")
    clean_slate()
    port = free_port()
    environment = {**os.environ, "SHOP_BROKER_URL": AMQP_URL, "SHOP_DATABASE_URL": POSTGRES_URL,
                   "SHOP_PROVIDER_DB": str(tmp_path / "provider.sqlite3"),
                   "PYTHONPATH": os.pathsep.join([str(SHOP), str(ROOT)])}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in (*SERVICES, "storefront")}
    try:
        for service in SERVICES:
            processes[service] = subprocess.Popen(
                [sys.executable, "-m", "idembus", "run", f"shop.{service}:make_endpoint",
                 "--workers", "2", "--shutdown-timeout", "10"],
                env=environment, cwd=tmp_path, stdout=logs[service], stderr=subprocess.STDOUT,
                start_new_session=True)
        for service in SERVICES:  # every worker consumes before anything is sent
            wait_until(lambda s=service: consumers(s) >= 2, 60, f"two {service} workers")
        processes["storefront"] = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "shop.storefront:create_app", "--factory",
             "--port", str(port), "--log-level", "warning"],
            env=environment, cwd=tmp_path, stdout=logs["storefront"],
            stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/orders/none"), 60,
                   "the storefront answering")
        yield Shop(environment, f"http://127.0.0.1:{port}", processes)
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            stop(process)
        for log in logs.values():
            log.close()
        for name in logs:
            text = (tmp_path / f"{name}.log").read_text(errors="replace")
            print(f"--- {name} ---\n{text[-4000:]}")
        clean_slate()


@pytest.mark.amqp
@pytest.mark.postgres
def test_the_tutorial_shop_end_to_end(shop: Shop) -> None:
    """20 orders over HTTP, each POSTed twice; a payments worker SIGKILLed after the 11th;
    the 8th paid with a card the provider blocks. Every other order is charged once and
    shipped once; the blocked one waits in the error queue, fails the same way when
    retried as it is, and completes when retried once its card is approved."""
    with httpx.Client(base_url=shop.base_url, timeout=10) as client:
        check_the_shop(shop, client)
    assert not queue_exists("storefront")  # a send-only endpoint: no queue, no consumer


def check_the_shop(shop: Shop, client: httpx.Client) -> None:
    from shop.provider import BLOCKED_CARD, FakePaymentProvider

    from idembus.storage.postgres import PostgresStorage

    orders: list[str] = []
    blocked = ""
    killed = 0
    for number in range(20):
        card = BLOCKED_CARD if number == 7 else "4242424242424242"
        key = f"req-{uuid.uuid4()}"
        form = {"customer": f"c-{number}", "card_number": card, "amount_cents": 100 + number}
        answer = client.post("/orders", json=form, headers={"Idempotency-Key": key})
        assert answer.status_code == 201, answer.text
        order_id = answer.json()["order_id"]
        again = client.post("/orders", json=form, headers={"Idempotency-Key": key})
        assert (again.status_code, again.json()["order_id"]) == (200, order_id)  # no 2nd order
        if card == BLOCKED_CARD:
            blocked = order_id
        else:
            orders.append(order_id)
        if number == 10:  # a payments worker dies mid-way, whatever it was doing
            victim = shop.workers("payments")[0]
            os.kill(victim, signal.SIGKILL)
            killed = victim

    def status(order_id: str) -> str:
        return str(client.get(f"/orders/{order_id}").json()["status"])

    wait_until(lambda: all(status(o) == "completed" for o in orders), 40,
               "every order but the blocked one completed")
    assert killed not in shop.workers("payments")
    wait_until(lambda: len(shop.workers("payments")) == 2, 20, "the killed worker replaced")

    provider = FakePaymentProvider(shop.environment["SHOP_PROVIDER_DB"])
    charged = [charge.description for charge in provider.charges()]
    assert sorted(charged) == sorted(f"order {o}" for o in orders)  # each once, no other
    shipping = PostgresStorage(POSTGRES_URL, table_prefix="shipping")
    try:
        assert [shipping.load("Shipment", o).state["parcels"] for o in orders] == [1] * 19
        assert not shipping.load("Shipment", blocked).exists
    finally:
        shipping.close()

    # The blocked order: in the error queue, its order still waiting for payment.
    def in_error_queue() -> list[dict[str, Any]]:
        listed = shop.cli("-m", "idembus", "errors", "list", "shop.payments:make_endpoint",
                          "--json")
        assert listed.returncode == 0, listed.stderr
        return list(json.loads(listed.stdout))

    # The blocked order: in the error queue (a copy per delivery of its one ChargePayment:
    # the repeated POSTs re-sent what they had stored), its order waiting for payment.
    failed = in_error_queue()
    assert {(m["message_type"], m["exception_type"]) for m in failed} == {
        ("shop.ChargePayment", "shop.provider.CardBlocked")}
    assert len({m["message_id"] for m in failed}) == 1, failed
    assert status(blocked) == "placed"

    # Retried before its cause is fixed, it fails the same way and comes back.
    retried = shop.cli("-m", "idembus", "errors", "retry", "shop.payments:make_endpoint",
                       failed[0]["message_id"])
    assert retried.returncode == 0, retried.stderr
    again = wait_until(in_error_queue, 20, "the blocked order back in the error queue")
    assert {m["message_id"] for m in again} == {failed[0]["message_id"]}

    # The cause fixed (the card approved at the provider), the retry completes it.
    assert shop.cli("-m", "shop.provider", "approve", BLOCKED_CARD).returncode == 0
    retried = shop.cli("-m", "idembus", "errors", "retry", "shop.payments:make_endpoint", "--all")
    assert retried.returncode == 0, retried.stderr
    wait_until(lambda: status(blocked) == "completed", 20, "the retried order completed")
    assert not in_error_queue()
    charged = [charge.description for charge in provider.charges()]
    assert sorted(charged) == sorted(f"order {o}" for o in [*orders, blocked])
