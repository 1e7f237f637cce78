"""The audit trail analysed on Spark (``idembus spark report``): per endpoint and message
type, how many messages arrived, how many were handled, found duplicate, redispatched,
failed or dead-lettered, and the processing latency of the handled ones.

The aggregation runs on Spark (DataFrame functions over :func:`idembus.spark.source.audit_frame`);
only its result, one row per (endpoint, message type), comes back to the driver, where it
becomes a text table, ``report.csv`` and the chart ``report.png``.

Columns:

``messages``
    distinct message ids (exact).
``handled``, ``duplicates``, ``redispatches``, ``failures``, ``dead_lettered``
    audit records of each outcome: one per handler, and one per failed attempt, so a
    message two handlers processed counts twice in ``handled``.
``p50_ms``, ``p95_ms``, ``p99_ms``
    latency in milliseconds from the message's ``time_sent`` to its ``handled`` record,
    over handled records that carry ``time_sent``. Approximate: Spark's
    ``percentile_approx`` with accuracy :data:`ACCURACY` returns an observed latency whose
    rank is within ``n / ACCURACY`` of the exact percentile's (exact below that many rows).
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from .source import DEFAULT_PARTITIONS, audit_frame

#: ``percentile_approx``'s accuracy: relative rank error at most 1 / ACCURACY.
ACCURACY = 10_000

#: The latency percentiles reported, as fractions.
PERCENTILES = (0.5, 0.95, 0.99)

#: The audit outcome counted in each column.
OUTCOME_COLUMNS = {
    "handled": "handled",
    "duplicates": "duplicate",
    "redispatches": "redispatched",
    "failures": "failed",
    "dead_lettered": "dead_lettered",
}


@dataclass(frozen=True)
class ReportRow:
    """The figures of one message type at one endpoint."""

    endpoint: str
    message_type: str
    messages: int
    handled: int
    duplicates: int
    redispatches: int
    failures: int
    dead_lettered: int
    #: Latency percentiles of handled records in ms; ``None`` without any with time_sent.
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


@dataclass(frozen=True)
class Report:
    """What :func:`report` computed and where it wrote it."""

    rows: tuple[ReportRow, ...]
    #: The rows as a text table, with a line saying how the latency was computed.
    table: str
    csv: Path
    chart: Path


def report(spark: SparkSession, endpoint_reference: str, *, out: Path,
           partitions: int = DEFAULT_PARTITIONS) -> Report:
    """Analyse the audit trail of ``endpoint_reference``'s storage (read in ``partitions``
    parallel parts) and write ``report.csv`` and ``report.png`` into ``out``."""
    frame = audit_frame(spark, endpoint_reference, partitions)
    rows = tuple(_report_row(row) for row in summarise(frame).collect())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(rows, out / "report.csv")
    chart_path = write_chart(rows, out / "report.png")
    return Report(rows=rows, table=format_table(rows), csv=csv_path, chart=chart_path)


def summarise(frame: DataFrame) -> DataFrame:
    """One row per (endpoint, message_type) of an audit frame, ordered by message type."""
    latencies = F.percentile_approx(
        F.when(F.col("outcome") == "handled", F.col("latency_ms")),
        list(PERCENTILES), ACCURACY)
    counts = [_count_of(outcome).alias(name) for name, outcome in OUTCOME_COLUMNS.items()]
    summary = frame.groupBy("endpoint", "message_type").agg(
        F.count_distinct("message_id").alias("messages"), *counts,
        latencies.alias("latency"))
    percentiles = [F.col("latency")[i].alias(_percentile_name(p))
                   for i, p in enumerate(PERCENTILES)]
    return (summary.select("endpoint", "message_type", "messages", *OUTCOME_COLUMNS,
                           *percentiles)
            .orderBy("message_type", "endpoint"))


def _count_of(outcome: str) -> Column:
    return F.count(F.when(F.col("outcome") == outcome, True))


def _percentile_name(fraction: float) -> str:
    return f"p{round(fraction * 100)}_ms"


def _report_row(row: Any) -> ReportRow:
    return ReportRow(**row.asDict())


_HEADINGS = ("endpoint", "message type", "messages", "handled", "duplicates", "redispatches",
             "failures", "dead-lettered", "p50 ms", "p95 ms", "p99 ms")


def format_table(rows: Sequence[ReportRow]) -> str:
    """The rows as an aligned text table (text left, numbers right)."""
    if not rows:
        return "no audit records (does the endpoint have the Audit middleware?)"
    cells = [_HEADINGS] + [_cells(row) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_HEADINGS))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
             for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"latency: time_sent to handled, approximate percentiles "
                 f"(percentile_approx, accuracy {ACCURACY})")
    return "\n".join(lines)


def _cells(row: ReportRow) -> tuple[str, ...]:
    values = dataclasses.astuple(row)
    return tuple(_format_value(value) for value in values)


def _format_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def write_csv(rows: Sequence[ReportRow], path: Path) -> Path:
    """``path`` with a header line and one line per row (empty cells for no latency)."""
    names = [field.name for field in dataclasses.fields(ReportRow)]
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(names)
        writer.writerows(["" if value is None else value for value in dataclasses.astuple(row)]
                         for row in rows)
    return path


def write_chart(rows: Sequence[ReportRow], path: Path) -> Path:
    """A PNG at ``path``: per message type (one line each), bars of handled, duplicates and
    failures, and beside them the p95 latency. Drawn on matplotlib's Agg canvas: no display
    needed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 2.0 + 0.7 * max(len(rows), 1)), layout="constrained")
    FigureCanvasAgg(figure)
    counts, latency = figure.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    if rows:
        _draw_counts(counts, _labels(rows), rows)
        _draw_latency(latency, rows)
        figure.legend(loc="outside lower center", ncols=3)
    else:
        for axes in (counts, latency):
            axes.text(0.5, 0.5, "no audit records", ha="center", va="center")
            axes.set_axis_off()
    figure.suptitle("idembus audit trail")
    figure.savefig(path, format="png", dpi=100)
    return path


def _labels(rows: Sequence[ReportRow]) -> list[str]:
    """Message types, prefixed with the endpoint when the trail has several endpoints."""
    several = len({row.endpoint for row in rows}) > 1
    return [f"{row.endpoint}: {row.message_type}" if several else row.message_type
            for row in rows]


def _draw_counts(axes: Any, labels: Sequence[str], rows: Sequence[ReportRow]) -> None:
    series = {"handled": [r.handled for r in rows], "duplicates": [r.duplicates for r in rows],
              "failures": [r.failures for r in rows]}
    height = 0.8 / len(series)
    for offset, (name, values) in enumerate(series.items()):
        positions = [i + (offset - (len(series) - 1) / 2) * height for i in range(len(rows))]
        bars = axes.barh(positions, values, height, label=name)
        axes.bar_label(bars, padding=2, fontsize=8)
    axes.set_yticks(range(len(rows)), labels)
    axes.invert_yaxis()  # first row on top, as in the table
    axes.set_xlabel("audit records")
    axes.set_title("outcomes per message type")
    axes.margins(x=0.15)


def _draw_latency(axes: Any, rows: Sequence[ReportRow]) -> None:
    values = [row.p95_ms or 0.0 for row in rows]
    bars = axes.barh(range(len(rows)), values, 0.6, color="tab:purple")
    axes.bar_label(bars, labels=[_format_value(row.p95_ms) for row in rows], padding=2,
                   fontsize=8)
    axes.set_xlabel("ms (approximate)")
    axes.set_title("p95 latency, handled")
    axes.margins(x=0.2)
