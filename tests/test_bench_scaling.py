"""``python -m bench.postgres --parts scaling``: the rounds it runs and the figures it derives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import pg_scaling
from bench.pg_clock import Window
from bench.pg_runner import Config, RunResult


def test_each_configuration_runs_first_in_one_of_four_rounds_and_every_round_runs_all() -> None:
    orders = [pg_scaling.order_of_round(index) for index in range(4)]

    assert [order[0] for order in orders] == list(pg_scaling.KEYS)
    assert all(sorted(order) == sorted(pg_scaling.KEYS) for order in orders)


def test_the_pairs_compare_the_same_threads_and_batch_with_one_and_two_processes() -> None:
    chosen = pg_scaling.configurations()

    one, two = chosen["idembus_1w"][1].settings, chosen["idembus_2w"][1].settings
    assert (one["workers"], two["workers"]) == (1, 2)
    assert (one["threads"], one["batch"]) == (two["threads"], two["batch"])
    assert [chosen[key][1].settings["processes"] for key in ("raw_1p", "raw_2p")] == [1, 2]


def test_medians_of_the_rounds_give_each_ratio_and_idembus_over_the_raw_loop(
        tmp_path: Path) -> None:
    # Workers' CPU per message of each configuration, round by round.
    cpu = {"idembus_1w": [200.0, 260.0, 210.0], "idembus_2w": [230.0, 231.0, 400.0],
           "raw_1p": [400.0, 380.0, 390.0], "raw_2p": [440.0, 430.0, 900.0]}
    taken = {key: iter(figures) for key, figures in cpu.items()}
    keys = {config.key: key for key, (_, config) in pg_scaling.configurations().items()}
    ran: list[str] = []

    def run(variant: Any, config: Config, **_: Any) -> RunResult:
        key = keys[config.key]
        ran.append(key)
        return RunResult(variant.name, config, Window(count=1000, started=0.0, ended=1.0),
                         cpu_us_per_msg={"workers": next(taken[key])})

    result = pg_scaling.measure(rounds=3, warmup=1, count=1000, logs=tmp_path, run=run)

    assert ran == [key for index in range(3) for key in pg_scaling.order_of_round(index)]
    assert result.median_cpu("idembus_1w") == 210.0
    assert result.idembus_ratio == pytest.approx(231.0 / 210.0)
    assert result.raw_ratio == pytest.approx(440.0 / 390.0)
    assert result.over_raw == pytest.approx((231.0 / 210.0) / (440.0 / 390.0))
    assert "idembus_over_raw=0.98" in result.line()
    assert result.as_json()["idembus_over_raw"] == pytest.approx(0.975, abs=1e-3)


def test_failed_runs_count_in_no_median_and_are_reported_as_problems(tmp_path: Path) -> None:
    def run(variant: Any, config: Config, **_: Any) -> RunResult:
        if config.settings.get("processes") == 2:
            return RunResult(variant.name, config, problems=["the broker went away"])
        return RunResult(variant.name, config, Window(count=10, started=0.0, ended=1.0),
                         cpu_us_per_msg={"workers": 100.0})

    result = pg_scaling.measure(rounds=1, warmup=1, count=10, logs=tmp_path, run=run)

    assert result.median_cpu("raw_2p") is None
    assert result.raw_ratio is None and result.over_raw is None
    assert result.idembus_ratio == pytest.approx(1.0)
    assert result.problems == ["raw_2p 2 processes: the broker went away"]
    assert "idembus_over_raw=n/a" in result.line()
