"""The ordering sample, end to end, with duplicates and crashes injected."""

from __future__ import annotations

import subprocess
import sys

import pytest

from idembus.testing.faults import RandomCrashes
from samples.ordering.__main__ import main
from samples.ordering.system import build, report, run
from tests.conftest import ALL_TRANSPORT_URLS, POSTGRES_URL, require_service, required_transport


@pytest.fixture(params=ALL_TRANSPORT_URLS)
def transport_url(request):
    """The sample on every transport (its storages are embedded mongomock)."""
    return required_transport(request.param)


def test_the_sample_applies_every_order_once_despite_duplicates_and_crashes(
    make_transport, unique, queue_name
):
    # Given the three endpoints with crashes injected at every crash point
    crashes = RandomCrashes(0.1, seed=3)
    system = build(make_transport, namespace=unique, middleware=[crashes])
    for endpoint in system.endpoints:
        queue_name(endpoint.name.removesuffix(f"-{unique}"))  # delete afterwards
    queue_name("error")
    try:
        # When 60 orders are placed, 12 of them twice with the same message id
        result = run(system, orders=60, duplicates=12, seed=5, timeout=120)
    finally:
        system.close()

    # Then the stores show each order placed, billed, charged and shipped exactly once
    assert result.ok, result.line()
    assert (result.placed, result.billed, result.charges, result.shipped) == (60, 60, 60, 60)
    assert result.lost == 0 and result.double_effects == 0
    assert result.duplicates_detected >= result.duplicates_injected == 12
    assert crashes.crashes > 0
    assert system.gateway.calls >= 60


def test_the_report_notices_a_double_effect(unique):
    # Given a finished run whose gateway then charges one order a second time
    system = build(namespace=unique)
    try:
        result = run(system, orders=5, duplicates=1, timeout=60)
        assert result.ok
        system.gateway.charge("order-0", 100, idempotency_key="another key")
        again = report(system, [f"order-{i}" for i in range(5)], 1)
    finally:
        system.close()
    # Then the line says so and the run is not ok
    assert again.double_effects == 1 and not again.ok


def test_the_demo_command_prints_one_line_from_the_stores(capsys):
    assert main(["--orders", "40", "--seed", "11"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    fields = dict(part.split("=") for part in line.split())
    assert list(fields) == ["orders", "placed", "billed", "shipped", "charges",
                            "duplicates_injected", "duplicates_detected", "redispatched",
                            "lost", "double_effects", "history_violations"]
    assert fields["lost"] == fields["double_effects"] == fields["history_violations"] == "0"
    assert int(fields["duplicates_detected"]) >= int(fields["duplicates_injected"]) > 0


def test_the_demo_runs_as_a_module_in_a_fresh_interpreter():
    done = subprocess.run([sys.executable, "-m", "samples.ordering", "--orders", "20"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("orders=20 placed=20 billed=20 shipped=20 charges=20")
    # no WARNING (events nobody subscribes to, the process-local parts): it says instead,
    # truthfully, what it runs on
    assert "WARNING" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[0] == (
        "ordering sample: queues on memory://, stores on mongomock, an in-memory MongoDB "
        "double; the queues and stores live in this process only and end with it (a trial: "
        "--transport and --storage name real services)")


@pytest.mark.postgres
def test_the_demo_runs_with_its_queues_in_postgresql_beside_its_tables(capsys):
    # Given the sample's queues and its stores in one PostgreSQL database
    require_service(POSTGRES_URL, "PostgreSQL")

    # When it runs, crashes injected
    status = main(["--orders", "40", "--seed", "5", "--crash-rate", "0.1",
                   "--transport", POSTGRES_URL, "--storage", POSTGRES_URL])

    # Then every order took effect once; with commit, send and acknowledgement in one
    # transaction, a crash after a commit is never delivered again, so nothing is redispatched
    (line,) = capsys.readouterr().out.strip().splitlines()
    fields = dict(part.split("=") for part in line.split())
    assert status == 0, line
    assert fields["lost"] == fields["double_effects"] == fields["redispatched"] == "0"
    assert fields["placed"] == fields["shipped"] == fields["charges"] == "40"


def test_the_demo_runs_on_the_mongodb_transport_served_by_mongomock(capsys):
    status = main(["--orders", "40", "--seed", "5", "--transport",
                   "mongodb://127.0.0.1:27017/shop", "--mongomock"])
    (line,) = capsys.readouterr().out.strip().splitlines()
    fields = dict(part.split("=") for part in line.split())
    assert status == 0, line
    assert fields["lost"] == fields["double_effects"] == "0"
    assert fields["placed"] == fields["shipped"] == fields["charges"] == "40"
