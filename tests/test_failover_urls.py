"""Several broker URLs, the nodes of one cluster: kombu's failover syntax or a list.

A connection goes to the node that answered last, and to the next ones when it does not;
the quorum queues' ``x-quorum-initial-group-size`` reaches the delay levels too, so that
they are replicated as the endpoint's queues are. (The cluster itself, nodes killed while
messages flow: tests/test_rabbitmq_cluster.py.)
"""

from __future__ import annotations

import logging
import socket
import threading
from urllib.parse import urlparse

import pytest

from idembus import headers as h
from idembus.envelope import Envelope
from idembus.errors import ConfigurationError
from idembus.transports import delays
from idembus.transports.kombu import KombuTransport
from idembus.transports.kombu_core import GROUP_SIZE
from tests.conftest import AMQP_URL, require_service

NODES = ["amqp://app:s3cret@10.0.0.1:5672/prod", "amqp://app:s3cret@10.0.0.2:5672/prod",
         "amqp://app:s3cret@10.0.0.3:5672/prod"]


def test_a_list_of_urls_and_the_failover_syntax_name_the_same_nodes():
    from_list = KombuTransport(NODES)
    from_text = KombuTransport(";".join(NODES))

    assert from_list.urls == from_text.urls == NODES
    assert from_list.url == from_text.url == ";".join(NODES)
    assert "s3cret" not in from_list.safe_url
    assert from_list.safe_url.count("***") == 3


def test_urls_of_two_protocols_are_refused_without_showing_a_password():
    with pytest.raises(ConfigurationError, match="mix schemes") as refused:
        KombuTransport([NODES[0], "redis://:s3cret@10.0.0.2:6379/0"])

    assert "s3cret" not in str(refused.value)


def test_no_url_at_all_is_refused():
    with pytest.raises(ConfigurationError, match="no broker URL"):
        KombuTransport([])


def test_the_group_size_of_the_quorum_queues_reaches_the_delay_levels():
    transport = KombuTransport(NODES, queue_arguments={GROUP_SIZE: 3})

    levels = transport._delay_levels.levels()
    assert {level.queue_arguments[GROUP_SIZE] for level in levels} == {3}
    assert transport._delay_levels.queue_arguments == {"x-queue-type": "quorum",
                                                       GROUP_SIZE: 3}
    # Without it the levels keep the arguments every earlier idembus declared them with
    plain = delays.Topology.for_queue_type("quorum")
    assert GROUP_SIZE not in plain.levels()[0].queue_arguments
    assert delays.Topology.for_queue_type("classic", 3).levels()[0].queue_arguments == (
        delays.levels()[0].queue_arguments)


@pytest.mark.parametrize("size", [0, -1, "3", 2.5, True])
def test_a_group_size_that_is_not_a_number_of_replicas_is_refused(size):
    with pytest.raises(ConfigurationError, match="whole number of replicas"):
        KombuTransport(NODES, queue_arguments={GROUP_SIZE: size})


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.amqp
def test_a_dead_node_is_passed_over_and_the_live_one_is_asked_first_next_time(unique):
    # Given a transport whose first node is down (nothing listens on its port)
    require_service(AMQP_URL, "RabbitMQ")
    parsed = urlparse(AMQP_URL)
    credentials = parsed.netloc.rpartition("@")[0]
    dead = parsed._replace(netloc=f"{credentials}@127.0.0.1:{closed_port()}").geturl()
    transport = KombuTransport([dead, AMQP_URL])
    queue = f"failover-{unique}"
    try:
        # When it declares a queue
        transport.declare(queue)

        # Then it did so on the live node, and connects to that node first from now on
        assert transport.pending(queue) == 0
        assert transport._preferred == 1
    finally:
        transport.delete_queue(queue)
        transport.close()


@pytest.mark.amqp
def test_a_quiet_consumer_keeps_its_connection_when_the_url_asks_for_heartbeats(unique,
                                                                                 caplog):
    # Given a consumer of an empty queue whose URL asks for a heartbeat every second
    require_service(AMQP_URL, "RabbitMQ")
    separator = "&" if "?" in AMQP_URL else "?"
    transport = KombuTransport(f"{AMQP_URL}{separator}heartbeat=1")
    queue = f"heartbeat-{unique}"
    transport.declare(queue)
    stop = threading.Event()
    received: list[str] = []

    def on_delivery(delivery):
        received.append(delivery.body.decode())
        delivery.ack()
        stop.set()

    consumer = threading.Thread(target=transport.consume, args=(queue, on_delivery),
                                kwargs={"stop": stop}, daemon=True)
    try:
        with caplog.at_level(logging.WARNING, logger="idembus.transports.kombu"):
            consumer.start()
            # When nothing arrives for longer than RabbitMQ waits for missed heartbeats
            # (two intervals), then a message does
            assert not stop.wait(6.0)
            transport.send(Envelope(body='"late"', headers={h.MESSAGE_ID: "m-1"},
                                    destination=queue))
            consumer.join(timeout=30)

        # Then it arrived on the connection the consumer had all along
        assert received == ['"late"']
        assert not [record for record in caplog.records if "reconnecting" in record.message]
    finally:
        stop.set()
        transport.delete_queue(queue)
        transport.close()
