"""``idembus schedules package.module:endpoint [--next N] [--json]``: each schedule of an
endpoint — its cron expression and time zone, what it sends, the last occurrence sent (from
the storage) and the next occurrences.

What was sent is read from the storage the endpoint's processes share: an endpoint on a
process-local storage (MemoryStorage, an embedded mongomock) is refused with exit status 2
and the reason, never shown as "never sent".
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from typing import Any

from ..envelope import format_utc, utc_now
from ..errors import ConfigurationError
from ..runtime.loading import load_endpoint, refuse_process_local
from ..runtime.scheduler import ScheduleState, read_state
from ..schedules import Schedule
from .errors import printable


def register(commands: Any, common: argparse.ArgumentParser) -> None:
    schedules = commands.add_parser(
        "schedules", parents=[common],
        help="list an endpoint's recurring messages: cron, time zone, last sent, next ones")
    schedules.add_argument("endpoint", help="package.module:endpoint")
    schedules.add_argument("--next", type=int, default=5, metavar="N",
                           help="how many next occurrences to list (5)")
    schedules.add_argument("--json", action="store_true", help="print JSON instead of text")
    schedules.set_defaults(handler=_schedules)


def _schedules(args: argparse.Namespace) -> int:
    if args.next < 0:
        raise ConfigurationError(f"--next must be 0 or more, got {args.next}")
    endpoint = load_endpoint(args.endpoint)
    now = utc_now()
    try:
        refuse_process_local(endpoint.storage, endpoint=endpoint.name, role="storage",
                             unseen="schedules' records (what was sent)")
        listed = [describe(schedule, read_state(endpoint.storage, endpoint.name, schedule.name),
                           now=now, count=args.next)
                  for schedule in endpoint.schedules]
    finally:
        endpoint.close()
    summary = {"endpoint": endpoint.name, "schedules": listed}
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


def describe(schedule: Schedule, state: ScheduleState | None, *, now: datetime.datetime,
             count: int) -> dict[str, Any]:
    """One schedule as a structure: its definition, its stored state (``None`` fields when
    no scheduler has run it) and its next ``count`` occurrences after ``now``."""
    upcoming = list(itertools.islice(schedule.occurrences(now), count))
    return {
        "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone,
        "catch_up": schedule.catch_up, "message": schedule.describe_message(),
        "since": _moment(schedule, state.since if state else None),
        "last_decided": _moment(schedule, state.last if state and state.last != state.since
                                else None),
        "last_sent": _moment(schedule, state.last_sent if state else None),
        "last_message_id": state.last_message_id if state else None,
        "sent": state.sent if state else 0,
        "skipped": state.skipped if state else 0,
        "failed": state.failed if state else 0,
        "last_error": state.last_error if state else None,
        "next": [_moment(schedule, moment) for moment in upcoming],
    }


def render(summary: dict[str, Any]) -> str:
    """The summary as text, a few lines per schedule."""
    schedules = summary["schedules"]
    lines = [f"endpoint {summary['endpoint']}: {len(schedules)} schedule(s)"]
    for item in schedules:
        missed = "sent late, in order" if item["catch_up"] else "skipped"
        lines.append(f"{item['name']}: cron {item['cron']!r} in {item['timezone']}, "
                     f"{item['message']}; missed occurrences {missed}")
        if item["since"] is None:
            lines.append("  not started yet: no scheduler has run it")
        else:
            sent = item["last_sent"]
            lines.append("  last sent  " + (f"{_shown(sent)}, id {item['last_message_id']}"
                                            if sent else "never"))
            lines.append(f"  since {_shown(item['since'])}: sent {item['sent']}, skipped "
                         f"{item['skipped']}, failed {item['failed']}")
            if item["last_error"]:
                lines.append(f"  last failure: {printable(item['last_error'])}")
        lines += [f"  {'next' if index == 0 else '    '}       {_shown(moment)}"
                  for index, moment in enumerate(item["next"])]
        if not item["next"]:
            lines.append("  next       none within 50 years")
    return "\n".join(lines)


def _moment(schedule: Schedule, moment: datetime.datetime | None) -> dict[str, str] | None:
    """A time in UTC and in the schedule's time zone."""
    if moment is None:
        return None
    local = moment.astimezone(schedule.zone)
    return {"utc": format_utc(moment),
            "local": f"{local:%Y-%m-%d %H:%M:%S} {local.tzname()}"}


def _shown(moment: dict[str, str]) -> str:
    return f"{moment['utc']} ({moment['local']})"
