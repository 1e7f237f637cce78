"""The ``bench:`` line of ``python -m bench.postgres``: the figures it derives from the runs."""

from __future__ import annotations

import pytest

from bench.pg_clock import Window
from bench.pg_runner import Config, RunResult
from bench.postgres import summary


def run(workers: int, rate: float, worker_cpu: float, batch: int = 50) -> RunResult:
    config = Config(f"w{workers}-{rate}", f"{workers} workers",
                    {"workers": workers, "batch": batch})
    return RunResult("idembus", config, Window(count=int(rate), started=0.0, ended=1.0),
                     cpu_us_per_msg={"workers": worker_cpu, "rabbitmq": 300.0})


def test_the_cpu_per_message_of_two_workers_is_compared_with_one_at_their_fastest_runs() -> None:
    results = {"idembus": [run(1, 1000, 700), run(1, 900, 650), run(2, 1300, 770),
                           run(2, 1200, 720)]}

    line, figures = summary(results)

    assert figures["cpu_worker_1w"] == 700  # the faster one-worker run, not the cheaper
    assert figures["cpu_worker_2w"] == 770
    assert figures["cpu_scaling_2w"] == pytest.approx(1.1)
    assert figures["scaling_2w"] == pytest.approx(1.3)
    assert "cpu_scaling_2w=1.10" in line and "cpu_worker_2w=770" in line


def test_without_a_two_worker_run_the_cpu_scaling_is_not_made_up() -> None:
    line, figures = summary({"idembus": [run(1, 1000, 700)]})

    assert figures["cpu_scaling_2w"] is None
    assert "cpu_scaling_2w=n/a" in line
