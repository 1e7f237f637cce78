"""What adding a worker process costs per message, with a loop that coordinates nothing as
the control (``python -m bench.postgres --parts scaling``).

On a machine of two cores, one idembus worker with its broker and database already keeps
both busy, so two workers cannot run twice as fast; what can be measured is the workers'
**CPU per message** with two processes against one. That figure has two parts: what idembus
adds when it runs twice (a coordination cost: more round trips, smaller batches, work that
is done per process), and what the machine adds to any work once more processes share its
two cores (their caches, the scheduler, RabbitMQ's deliveries to two consumers).

To tell them apart the part runs, in each of ``rounds`` rounds and in an order that turns
round by round, idembus with one and with two processes of the same threads and batch size
(:data:`IDEMBUS_THREADS`, :data:`IDEMBUS_BATCH`), and the raw per-message kombu loop of
:mod:`bench.pg_raw` (consume, SQL, publish with confirms, ack, nothing shared between its
processes) with one and two processes — the same configurations as the grid's, each with
``count`` timed messages after ``warmup``. It reports the median of each configuration's
workers' CPU per message, each pair's ratio, and idembus's ratio over the raw loop's:
about 1.0 when adding an idembus worker costs no more than adding a process that
coordinates nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.pg_idembus import DEFAULT_BATCH, IdembusVariant, configuration
from bench.pg_raw import RawVariant
from bench.pg_runner import Config, RunResult, Variant, run_configuration

#: Consumer threads per idembus process, and its batch size, in both configurations: the
#: threads of the grid's best runs.
IDEMBUS_THREADS = 2
IDEMBUS_BATCH = DEFAULT_BATCH
#: The configurations' keys in the results, in the order of the first round.
KEYS = ("idembus_1w", "idembus_2w", "raw_1p", "raw_2p")


@dataclass
class ScalingResult:
    rounds: int
    #: Each configuration's runs, by key (:data:`KEYS`).
    runs: dict[str, list[RunResult]] = field(default_factory=dict)

    def median_cpu(self, key: str) -> float | None:
        """The median of the workers' CPU per message (us) over ``key``'s clean runs."""
        figures = [run.cpu_us_per_msg["workers"] for run in self.runs.get(key, [])
                   if run.rate is not None and "workers" in run.cpu_us_per_msg]
        return statistics.median(figures) if figures else None

    def ratio(self, two: str, one: str) -> float | None:
        first, second = self.median_cpu(one), self.median_cpu(two)
        return None if not first or second is None else second / first

    @property
    def idembus_ratio(self) -> float | None:
        return self.ratio("idembus_2w", "idembus_1w")

    @property
    def raw_ratio(self) -> float | None:
        return self.ratio("raw_2p", "raw_1p")

    @property
    def over_raw(self) -> float | None:
        """idembus's two-over-one ratio over the raw loop's."""
        if self.idembus_ratio is None or not self.raw_ratio:
            return None
        return self.idembus_ratio / self.raw_ratio

    @property
    def problems(self) -> list[str]:
        return [f"{key} {run.config.label}: {problem}"
                for key, runs in self.runs.items() for run in runs for problem in run.problems]

    def as_json(self) -> dict[str, Any]:
        def rounded(value: float | None, digits: int) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "rounds": self.rounds,
            "cpu_us_per_msg_median": {key: rounded(self.median_cpu(key), 1) for key in KEYS},
            "cpu_us_per_msg_runs": {key: [run.cpu_us_per_msg.get("workers")
                                          for run in self.runs.get(key, [])] for key in KEYS},
            "msgs_per_s_runs": {key: [rounded(run.rate, 1) for run in self.runs.get(key, [])]
                                for key in KEYS},
            "idembus_cpu_2w_over_1w": rounded(self.idembus_ratio, 3),
            "raw_cpu_2p_over_1p": rounded(self.raw_ratio, 3),
            "idembus_over_raw": rounded(self.over_raw, 3),
            "problems": self.problems,
        }

    def line(self) -> str:
        def figure(value: float | None, spec: str) -> str:
            return "n/a" if value is None else format(value, spec)

        cpu = " ".join(f"cpu_{key}={figure(self.median_cpu(key), '.0f')}" for key in KEYS)
        return (f"scaling: {cpu} idembus_2w_over_1w={figure(self.idembus_ratio, '.2f')} "
                f"raw_2p_over_1p={figure(self.raw_ratio, '.2f')} "
                f"idembus_over_raw={figure(self.over_raw, '.2f')} (workers' CPU in us a "
                f"message, median of {self.rounds} rounds; idembus {IDEMBUS_THREADS} threads "
                f"a process, batch {IDEMBUS_BATCH})")


def configurations() -> dict[str, tuple[Variant, Config]]:
    """The four configurations by key: idembus with one and two processes, the raw loop
    with one and two."""
    idembus, raw = IdembusVariant(), RawVariant()
    raw_configs = {config.settings["processes"]: config
                   for config in raw.configurations(quick=True)}
    return {
        "idembus_1w": (idembus, configuration(1, IDEMBUS_THREADS, IDEMBUS_BATCH)),
        "idembus_2w": (idembus, configuration(2, IDEMBUS_THREADS, IDEMBUS_BATCH)),
        "raw_1p": (raw, raw_configs[1]),
        "raw_2p": (raw, raw_configs[2]),
    }


def order_of_round(index: int) -> list[str]:
    """The configurations' order in round ``index`` (from 0): turned by one each round,
    so that no configuration always runs first, or always right after another one."""
    shift = index % len(KEYS)
    return [*KEYS[shift:], *KEYS[:shift]]


def measure(*, rounds: int, warmup: int, count: int, logs: Path,
            run: Callable[..., RunResult] = run_configuration) -> ScalingResult:
    """``rounds`` rounds of the four configurations (see the module docstring)."""
    chosen = configurations()
    result = ScalingResult(rounds, {key: [] for key in KEYS})
    for index in range(rounds):
        for key in order_of_round(index):
            variant, config = chosen[key]
            outcome = run(variant, config, warmup=warmup, count=count, logs=logs)
            result.runs[key].append(outcome)
            cpu = outcome.cpu_us_per_msg.get("workers")
            shown = (f"{outcome.rate:6.0f} msgs/s, workers {cpu:.0f} us/msg"
                     if outcome.rate is not None and cpu is not None
                     else "failed: " + "; ".join(outcome.problems))
            print(f"  [round {index + 1}/{rounds}] {key:<11} {config.label:<36} {shown}",
                  flush=True)
    return result
