"""The overview (after Flower's): each endpoint with its instances and an hour of
per-minute charts, refreshed in place by the shipped script."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from ..envelope import parse_utc
from ..redaction import redact
from ..runtime.counters import LEDGER
from ..runtime.recoverability import error_queue
from ..runtime.status import HIDDEN_AFTER, duration_text, queue_depth, summarise
from . import charts
from .history import CHARTED, PERCENTILES
from .html import Markup, render, tag, url
from .layout import moment, notice, pairs, table

if TYPE_CHECKING:
    from ..runtime.endpoint import Endpoint
    from .service import Dashboard

#: A running process that has not reported for this many status intervals is stale.
STALE_AFTER_INTERVALS = 3
#: The ledger's columns of the instance table: received, then the terms that add up to it.
SHOWN = ("received", *LEDGER)
#: What a figure nobody can tell reads as.
UNKNOWN = "–"


def overview(dashboard: Dashboard, now: datetime.datetime) -> Markup:
    """Every endpoint's section (the part the page refreshes)."""
    return render([_endpoint(dashboard, endpoint, now)
                   for endpoint in dashboard.endpoints.values()])


def _endpoint(dashboard: Dashboard, endpoint: Endpoint, now: datetime.datetime) -> Markup:
    name = endpoint.name
    sampler = dashboard.samplers[name]
    recent = [r for r in sampler.latest if now - r.updated_at <= HIDDEN_AFTER]
    # Stopped instances collapse after a while: counted, no longer listed.
    reports = [r for r in recent
               if not r.stopped or now - r.updated_at <= dashboard.stopped_shown_for]
    stale_after = datetime.timedelta(seconds=STALE_AFTER_INTERVALS * endpoint.status_interval)
    summary = summarise(name, reports, now=now, stale_after=stale_after)
    collapsed = len(recent) - len(reports)
    states = [instance["state"] for instance in summary["instances"]]
    history = sampler.history
    minutes = history.minutes(now)
    counts = {key: history.series(key, now) for key, _ in CHARTED}
    problem = dashboard.problems.get(name)
    return tag(
        "section",
        tag("h2", name, " ", tag("span", f"{states.count('running')} running", class_="badge ok"),
            " ", tag("span", f"{states.count('stale')} lost",
                     class_="badge warn" if "stale" in states else "badge"),
            " ", tag("span", f"{states.count('stopped') + collapsed} stopped", class_="badge")),
        notice(f"status reports cannot be read: {problem}", "error") if problem else None,
        None if endpoint.send_only else _input_queue(endpoint, summary, now),
        _queues(dashboard, endpoint),
        tag("div", [tag("div", tag("span", f"{sum(counts[key]):,}", class_="figure",
                                   data_counter=key),
                           tag("span", f"{title.lower()} in the hour", class_="caption"),
                           class_="tile") for key, title in CHARTED], class_="tiles"),
        tag("div", [tag("figure", charts.bars(f"{title} per minute", minutes, counts[key]),
                        tag("figcaption", f"{title} per minute")) for key, title in CHARTED]
            + [tag("figure", charts.lines(
                "Handling time per minute", minutes,
                {label: history.percentiles(fraction, now) for fraction, label in PERCENTILES},
                "ms"), tag("figcaption", "Handling time (ms): p50, p95, p99"))],
            class_="charts"),
        tag("h3", "Instances"),
        _instances(summary, private=dashboard.shows_hosts),
        tag("p", f"{collapsed} instance(s) stopped more than "
                 f"{_minutes(dashboard.stopped_shown_for)} ago not listed",
            class_="caption collapsed") if collapsed else None,
        _legend(),
        _signal_counters(summary),
        class_="endpoint", data_endpoint=name)


def _input_queue(endpoint: Endpoint, summary: dict[str, Any],
                 now: datetime.datetime) -> Markup:
    """The endpoint's queue as its transport tells it ("–" for what it cannot), and how
    far behind its consumers are: when the last delivery was settled, and how long after
    it was sent (or due)."""
    # (`idembus dashboard` refuses a process-local broker; one built in a process sees
    # that process's memory://)
    depth = queue_depth(endpoint.transport, endpoint.name)

    def figure(key: str, text: str | None = None) -> Markup:
        value = depth[key]
        shown = UNKNOWN if value is None else (text if text is not None else str(value))
        return tag("span", shown, data_counter=f"queue_{key}")

    oldest = depth["oldest_seconds"]
    parts: list[Any] = [
        "Queue ", tag("code", endpoint.name), ": ", figure("ready"), " ready, ",
        figure("unacked"), " unacknowledged, ", figure("delayed"), " delayed, ",
        figure("consumers"), " consumer(s); the oldest ready message has waited ",
        figure("oldest_seconds", duration_text(oldest) if oldest is not None else None), ". "]
    if depth["unknown"]:
        parts += [tag("span", f"({depth['unknown']}) ", class_="caption")]
    settled = parse_utc(summary["last_settled"])
    lag = summary["lag_seconds"]
    parts += ["Last message settled ",
              tag("span", f"{duration_text((now - settled).total_seconds())} ago"
                  if settled is not None else "never", data_counter="last_settled"),
              ", ", tag("span", duration_text(lag) if lag is not None else UNKNOWN,
                        data_counter="lag"),
              " after it was sent or due (lag)."]
    return tag("p", parts, class_="queues input")


def _queues(dashboard: Dashboard, endpoint: Endpoint) -> Markup:
    """The error queue's depth and the parked messages, linking to them."""
    try:
        waiting: Any = endpoint.transport.pending(endpoint.error_queue)
    except Exception as error:
        waiting = f"unknown ({redact(str(error))})"
    try:
        parked: Any = sum(1 for _ in error_queue.stored(endpoint))  # a page at a time
    except Exception as error:
        parked = f"unknown ({redact(str(error))})"
    return tag("p", "Error queue ", tag("code", endpoint.error_queue), ": ",
               tag("a", str(waiting), href=url("/errors", {"endpoint": endpoint.name}),
                   data_counter="error_queue"),
               " message(s) waiting to be moved (every endpoint's); failed messages in the "
               "storage: ",
               tag("span", str(parked), data_counter="parked"), ".", class_="queues")


def _instances(summary: dict[str, Any], *, private: bool) -> Markup:
    """One row per instance with its ledger, and the total of the running ones."""
    rows = []
    for instance in summary["instances"]:
        name = instance["instance"] if private else instance["instance"].rsplit(":", 1)[-1]
        problems = [f"{source}: {text}" for source, text in sorted(instance["problems"].items())]
        rows.append([
            tag("code", name), _state(instance["state"]),
            moment(instance["started_at"]), moment(instance["updated_at"]),
            *(tag("span", str(instance["ledger"][key]), data_counter=key) for key in SHOWN),
            render([tag("div", problem, class_="problem") for problem in problems]) or "-",
        ])
    head = ["instance" if private else "instance (host and pid on loopback or with "
            "authentication)",
            "state", "started", "last report",
            *(tag("abbr", key.replace("_", " "), title=LEDGER.get(key, "deliveries received"))
              for key in SHOWN), "problems"]
    total = tag("tr", tag("th", "total (running)", scope="row", colspan=4),
                [tag("td", tag("span", str(summary["ledger"][key]), data_total=key))
                 for key in SHOWN], tag("td", ""))
    return table(head, rows, empty="no instance reported in the last hour",
                 foot=total if rows else None, class_="instances")


def _legend() -> Markup:
    """How the ledger adds up, and what each of its terms means."""
    return tag("details", tag("summary", "received = ",
                              " + ".join(key.replace("_", " ") for key in LEDGER)),
               tag("dl", [(tag("dt", key.replace("_", " ")), tag("dd", meaning))
                          for key, meaning in LEDGER.items()]),
               class_="ledger", open=True)


def _signal_counters(summary: dict[str, Any]) -> Markup:
    """Every signal counter of the running instances, for what the ledger sums up."""
    return tag("details", tag("summary", "Signal counters of the running instances (per "
                                         "handler, attempt or message sent: they do not add "
                                         "up to received)"),
               pairs(((key.replace("_", " "), tag("span", str(value), data_signal=key))
                      for key, value in summary["total"].items())),
               class_="signals")


#: How an instance's state reads: one that stopped reporting without saying it stopped was
#: most likely killed (or hangs).
_STATE_LABELS = {"stale": "lost", "running": "running", "stopped": "stopped"}


def _state(state: str) -> Markup:
    label = _STATE_LABELS.get(state, state)
    title = ("no status report for three intervals and no word that it stopped: killed, "
             "or hung" if state == "stale" else None)
    return tag("span", label, class_=f"state {state}", title=title)


def _minutes(span: datetime.timedelta) -> str:
    minutes = span.total_seconds() / 60
    return f"{minutes:g} minute(s)"
