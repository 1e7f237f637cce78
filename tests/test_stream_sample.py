"""samples.stream: the ordering sample's events read over HTTP by three clients."""

from __future__ import annotations

import pytest

from samples.stream.__main__ import main


def test_every_client_of_the_stream_sample_gets_its_orders_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--orders", "80", "--seed", "3"]) == 0
    fields = dict(item.split("=", 1) for item in capsys.readouterr().out.split())
    assert fields["orders"] == fields["journaled"] == fields["follower"] == "80"
    assert int(fields["follower_connections"]) >= 3  # it was cut off and resumed
    assert fields["replica"] == "80" and int(fields["replica_states"]) > 0
    followed, of = fields["customer"].split("/")
    assert followed == of and int(of) > 0
    assert (fields["repeated"], fields["lost"], fields["errors"]) == ("0", "0", "none")
