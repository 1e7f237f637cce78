"""One gateway process holds many idle connections and many streaming clients on loopback in
bounded memory, and every streaming client gets every event appended meanwhile.

Reduced here (200 idle connections, 20 streams); ``IDEMBUS_GATEWAY_LOAD=full`` runs the full
size (2,000 and 100), as ``make bench`` does (``bench.gateway``). The gateway runs as
``idembus gateway`` in a process of its own, so that the memory measured is its own.
"""

from __future__ import annotations

import os

import pytest

from bench.gateway import raise_open_files_limit, run_load
from tests.conftest import POSTGRES_URL, require_service

FULL = os.environ.get("IDEMBUS_GATEWAY_LOAD", "").lower() == "full"
IDLE, STREAMS, EVENTS = (2000, 100, 5000) if FULL else (200, 20, 2000)
#: Resident memory an idle connection may add to the gateway, at most (uvicorn's protocol
#: object, h11's state, asyncio's transport: a few KiB each).
PER_CONNECTION_KIB = 64
#: What the streams' buffers, the event cache and the worker threads may add on top.
STREAMING_MIB = 60


@pytest.mark.postgres
def test_a_gateway_holds_idle_connections_and_streams_every_event_to_every_client(
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_service(POSTGRES_URL, "PostgreSQL")
    if not raise_open_files_limit(IDLE + STREAMS + 200):
        pytest.skip(f"the hard limit of open files is below {IDLE + STREAMS + 200}: this "
                    "machine cannot hold the connections (raise ulimit -Hn)")

    report = run_load(POSTGRES_URL, idle=IDLE, streams=STREAMS, events=EVENTS, timeout=120)
    with capsys.disabled():
        print(f"\n{report.line()}")

    # Every connection was held at once
    assert report.open_connections >= IDLE + STREAMS
    # Every client got every event, once, in order (the reader checks each position)
    assert report.delivered == [EVENTS] * STREAMS
    assert report.delivery_ratio == 1.0
    # Memory grew by a few KiB per connection, and streaming stayed bounded
    connections = IDLE + STREAMS
    assert report.rss_connected_mib - report.rss_start_mib < (
        connections * PER_CONNECTION_KIB / 1024)
    assert report.rss_peak_mib < report.rss_connected_mib + STREAMING_MIB
