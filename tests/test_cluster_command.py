"""``python -m idembus.testing.cluster`` without starting a node: what each node is given,
and the command's answers when there is no cluster. (The nodes themselves run in
tests/test_rabbitmq_cluster.py.)"""

from __future__ import annotations

import json
import stat

import pytest

from idembus.testing.cluster import RabbitCluster, main


def test_each_node_gets_its_own_name_ports_and_directories_and_one_cookie(tmp_path):
    cluster = RabbitCluster(tmp_path, amqp_port=6001, dist_port=26001, prefix="t")

    cluster._prepare()

    assert [(node.nodename, node.amqp_port, node.dist_port) for node in cluster.nodes.values()
            ] == [("t-a@localhost", 6001, 26001), ("t-b@localhost", 6002, 26002),
                  ("t-c@localhost", 6003, 26003)]
    config = (tmp_path / "b" / "rabbitmq.conf").read_text()
    assert "listeners.tcp.1 = 127.0.0.1:6002" in config
    assert "cluster_formation.classic_config.nodes.3 = t-c@localhost" in config
    assert "cluster_partition_handling = pause_minority" in config
    cookie = tmp_path / "home" / ".erlang.cookie"
    assert stat.S_IMODE(cookie.stat().st_mode) == 0o400 and len(cookie.read_text()) == 32
    assert (tmp_path / "a" / "enabled_plugins").read_text() == "[].\n"
    assert cluster.failover_url("shop") == (
        "amqp://guest:guest@127.0.0.1:6001/shop;amqp://guest:guest@127.0.0.1:6002/shop;"
        "amqp://guest:guest@127.0.0.1:6003/shop")
    # What start records is what the command line finds again
    again = RabbitCluster.load(tmp_path)
    assert again.nodes == cluster.nodes
    assert json.loads((tmp_path / "cluster.json").read_text())["prefix"] == "t"


def test_no_node_runs_before_start(tmp_path):
    cluster = RabbitCluster(tmp_path)

    assert cluster.running() == []
    assert cluster.pid("a") is None


def test_a_cluster_has_one_to_26_nodes(tmp_path):
    with pytest.raises(ValueError, match="1 to 26 nodes"):
        RabbitCluster(tmp_path, size=0)


def test_the_command_says_when_there_is_no_cluster(tmp_path, capsys):
    assert main(["--dir", str(tmp_path), "status"]) == 1
    assert "no cluster in" in capsys.readouterr().err


def test_the_command_asks_which_node_to_kill(tmp_path):
    RabbitCluster(tmp_path)._prepare()

    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path), "kill"])
