"""Throughput of the Sales -> Billing flow, as a ratio to a raw kombu loop.

What is measured
================
N PlaceOrder commands (10,000 by default) for N distinct orders wait in Sales' queue;
Sales handles each (its Order aggregate, one conditional commit) and publishes
OrderPlaced; Billing handles each (stateless inbox record, a fake payment gateway) and
publishes OrderBilled. A run ends with N aggregates in Sales' storage and N inbox records
in Billing's. The rate is 2N handled messages over the time from Sales' first delivery to
Billing's Nth handled message.

Against what
============
:mod:`bench.raw_flow`: two bare kombu consume -> publish -> ack loops doing the same broker
work (same messages, topology, prefetch, persistence, confirm setting, separate publishing
connections, one thread per queue) and nothing else; see its docstring. The ratio
idembus / raw is the price of idempotent handling on this machine with this broker; the
absolute figures are not portable, the ratio is the figure to track.

Each variant runs ``--rounds`` times (default 3) in one process, in a rotating order after
an untimed warm-up; the table shows the **median** of the rounds and every round.
By default idembus runs on the storage an Endpoint given none uses (MemoryStorage: what
``make demo`` users get, and the bus' own overhead with a storage that costs next to
nothing) and on PostgreSQL at ``IDEMBUS_POSTGRES_URL`` (what users deploy; skipped, with
the reason, when it cannot be reached). ``--storages default,mongomock`` adds mongomock,
MongoStorage's test double and the default until issue 15: it scans whole collections,
so its rate falls as N grows (use ``--messages 2000`` or less with it).

What middleware costs
=====================
On the default storage and on PostgreSQL the flow runs again with five no-op middleware, with
tracing recording every trace and with tracing keeping one trace in ten
(:mod:`bench.middleware_cost`); each is reported as the median over rounds of its rate
over the same storage's rate without middleware in the same round.

Run ``python -m bench.throughput`` (``make bench``); ``--help`` lists the options.
Results also go to ``bench/results/throughput.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import kombu

from bench import idembus_flow, middleware_cost, raw_flow
from bench.common import (
    TRANSPORT_URLS,
    Measurement,
    display_url,
    kombu_options,
    unreachable_reason,
)
from bench.profiling import profile_run
from idembus.pipeline import Middleware
from idembus.transports.kombu import KombuTransport

RESULTS = Path(__file__).resolve().parent / "results" / "throughput.json"
WARM_UP_ORDERS = 100

Runner = Callable[[str, int], float]
#: variant key -> (label in the table, runner)
Variants = dict[str, tuple[str, Runner]]


def variants(storages: Sequence[str], *, confirm: bool, middleware: bool = True) -> Variants:
    chosen: Variants = {"raw": ("raw kombu loop", _raw_runner(confirm))}
    for storage in storages:
        chosen[_variant_key(storage)] = (storage_label(storage),
                                          _idembus_runner(storage, confirm))
        if middleware and storage in MIDDLEWARE_STORAGES:  # the pipeline's cost, against none
            for suffix, (label, factory) in MIDDLEWARE_VARIANTS.items():
                chosen[middleware_key(storage, suffix)] = (
                    label, _idembus_runner(storage, confirm, factory))
    return chosen


def storage_label(storage: str) -> str:
    """How the table names idembus on ``storage``."""
    if storage == "default":
        return f"idembus + {idembus_flow.default_storage_name()} (default)"
    return {"mongomock": "idembus + mongomock", "memory": "idembus + MemoryStorage",
            "postgres": "idembus + PostgreSQL"}[storage]


#: Storages whose flow is measured again with each of :data:`MIDDLEWARE_VARIANTS`.
MIDDLEWARE_STORAGES = ("default", "postgres")
#: key suffix -> (label, middleware factory): each measured on the storages of
#: :data:`MIDDLEWARE_STORAGES` and compared with the same storage without middleware in
#: the same round.
MIDDLEWARE_VARIANTS: dict[str, tuple[str, Callable[[], list[Middleware]]]] = {
    "5_noop_middleware": ("  + 5 no-op middleware", middleware_cost.five_no_ops),
    "tracing": ("  + tracing, no-op exporter", middleware_cost.tracing),
    "tracing_sampled": ("  + tracing, 1 trace in 10", middleware_cost.tracing_sampled),
}


def middleware_key(storage: str, suffix: str) -> str:
    """``idembus_tracing`` on the default storage (the first names, kept), and
    ``idembus_postgresstorage_tracing`` on another storage."""
    return f"idembus_{suffix}" if storage == "default" else f"{_variant_key(storage)}_{suffix}"


def middleware_pairs(results: dict[str, Measurement]) -> Iterator[tuple[str, str, str, str]]:
    """(storage, suffix, key, key of the same storage without middleware) of every
    middleware variant measured, with its base."""
    for storage in MIDDLEWARE_STORAGES:
        base = _variant_key(storage)
        for suffix in MIDDLEWARE_VARIANTS:
            key = middleware_key(storage, suffix)
            if key in results and base in results:
                yield storage, suffix, key, base


def _variant_key(storage: str) -> str:
    return "idembus" if storage == "default" else f"idembus_{storage}storage"


def _raw_runner(confirm: bool) -> Runner:
    return lambda url, count: raw_flow.run(url, count, confirm=confirm)


def _idembus_runner(storage: str, confirm: bool,
                    middleware: Callable[[], list[Middleware]] = list) -> Runner:
    return lambda url, count: idembus_flow.run(url, storage, count, confirm=confirm,
                                               middleware=middleware)


def measure(url: str, orders: int, rounds: int, chosen: Variants) -> dict[str, Measurement]:
    """Warm up, then run every variant ``rounds`` times in rotating order."""
    for _, runner in chosen.values():
        runner(url, min(WARM_UP_ORDERS, orders))
    results = {key: Measurement(key, 2 * orders) for key in chosen}
    keys = list(chosen)
    for round_index in range(rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            results[key].seconds.append(chosen[key][1](url, orders))
            print(f"  round {round_index + 1}: {chosen[key][0]:<34} "
                  f"{results[key].rates[-1]:>9.0f} msgs/s", flush=True)
    return results


def confirms(url: str, wanted: bool) -> bool:
    """The confirm setting both sides use; refuses to run if they would differ."""
    idembus = KombuTransport(url, confirm_publish=wanted).publisher_confirms
    raw = bool(kombu_options(url, confirm=wanted).get("confirm_publish"))
    if idembus != raw:
        raise SystemExit(f"confirm settings differ on {url}: idembus {idembus}, raw {raw}")
    return raw


def print_table(name: str, orders: int, results: dict[str, Measurement],
                chosen: Variants) -> None:
    raw = results["raw"].median
    print(f"\n{name}: {orders} orders = {2 * orders} messages per run, median of "
          f"{len(results['raw'].seconds)} rounds")
    print(f"{'variant':<35} {'msgs/s':>9} {'x raw':>7}  rounds (msgs/s)")
    for key, measurement in results.items():
        rounds = " ".join(f"{rate:.0f}" for rate in measurement.rates)
        print(f"{chosen[key][0]:<35} {measurement.median:>9.0f} "
              f"{measurement.median / raw:>7.3f}  {rounds}")
    if "idembus_mongomockstorage" in results:
        print("(mongomock scans a whole collection per query: its rate falls as N grows)")
    for storage in MIDDLEWARE_STORAGES:
        pairs = [(key, base) for each, _, key, base in middleware_pairs(results)
                 if each == storage]
        if pairs:
            print(f"middleware cost, against {storage_label(storage).removeprefix('idembus + ')}"
                  " without middleware (median of the rounds' ratios): " + ", ".join(
                      f"{chosen[key][0].strip()} {paired_ratio(results, key, base):.3f}x"
                      for key, base in pairs))


def paired_ratio(results: dict[str, Measurement], key: str, base: str) -> float:
    """The median over rounds of ``key``'s rate / ``base``'s rate in the same round: each
    round runs every variant back to back, so a busy moment of the machine weighs on both
    sides of a ratio rather than on one median."""
    pairs = zip(results[key].rates, results[base].rates, strict=True)
    return float(statistics.median(rate / plain for rate, plain in pairs))


def summary(report: dict[str, Any]) -> str:
    """``bench: aggregates=N default_storage=... memory_idembus=... memory_raw=...
    memory_ratio=... amqp_...`` (idembus on the default storage), then the middleware
    figures on it (``memory_tracing_vs_none=...``), then the other storages measured
    (``amqp_idembus_postgresstorage=... amqp_postgres_tracing_vs_none=...``)."""
    fields = [f"aggregates={report['orders']}", f"default_storage={report['default_storage']}"]
    extra: list[str] = []
    for name, entry in report["transports"].items():
        medians = {key: v["median_msgs_per_s"] for key, v in entry.get("variants", {}).items()}
        ratios = entry.get("ratios", {})
        costs = entry.get("middleware_cost", {})
        for storage, target in (("default", fields), ("memory", extra), ("mongomock", extra),
                                ("postgres", extra)):
            key = _variant_key(storage)
            if storage in ("memory", "mongomock") and key not in medians:
                continue  # measured only on request
            suffix = key.removeprefix("idembus")
            target.append(f"{name}_idembus{suffix}={_figure(medians.get(key), '.0f')}")
            if key == "idembus":
                target.append(f"{name}_raw={_figure(medians.get('raw'), '.0f')}")
            target.append(f"{name}_ratio{suffix}={_figure(ratios.get(key), '.3f')}")
            if storage in MIDDLEWARE_STORAGES:
                prefix = "" if storage == "default" else f"{storage}_"
                for cost in MIDDLEWARE_VARIANTS:
                    extra.append(f"{name}_{prefix}{cost}_vs_none="
                                 f"{_figure(costs.get(middleware_key(storage, cost)), '.3f')}")
    return "bench: " + " ".join(fields + extra)


def _figure(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def transport_report(url: str, results: dict[str, Measurement] | None,
                     skipped: str | None, confirm: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"url": display_url(url), "skipped": skipped}
    if results is None:
        return entry
    raw = results["raw"].median
    entry["confirm_publish"] = confirms(url, confirm)
    entry["variants"] = {key: m.as_json() for key, m in results.items()}
    entry["ratios"] = {key: round(m.median / raw, 4) for key, m in results.items()
                       if key != "raw"}
    entry["middleware_cost"] = {key: round(paired_ratio(results, key, base), 4)
                                for _, _, key, base in middleware_pairs(results)}
    return entry


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results written to {path}")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    storages = reachable(args.storages)
    chosen = variants(storages, confirm=args.confirm)
    report: dict[str, Any] = {
        "generated": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(), "kombu": kombu.__version__,
        "orders": args.messages, "messages_per_run": 2 * args.messages,
        "rounds": args.rounds, "statistic": "median", "confirms_requested": args.confirm,
        "storages": storages, "default_storage": idembus_flow.default_storage_name(),
        "transports": {},
    }
    for name in args.transports:
        url = TRANSPORT_URLS[name]
        reason = unreachable_reason(url)
        results = None
        if reason:
            print(f"\n{name}: skipped: {reason}")
        else:
            print(f"\n{name}: {display_url(url)}; publisher confirms on both sides: "
                  f"{_confirm_text(confirms(url, args.confirm), args.confirm)}")
            results = measure(url, args.messages, args.rounds, chosen)
            print_table(name, args.messages, results, chosen)
        report["transports"][name] = transport_report(url, results, reason, args.confirm)
    return report


def reachable(storages: Sequence[str]) -> list[str]:
    """``storages`` less those that cannot be used here (each said, with the reason)."""
    kept = []
    for storage in storages:
        reason = idembus_flow.unavailable(storage)
        if reason:
            print(f"storage {storage} skipped: {reason}")
        else:
            kept.append(storage)
    return kept


def _confirm_text(used: bool, wanted: bool) -> str:
    if used:
        return "on"
    return "off (the broker has none)" if wanted else "off (--no-confirms)"


def profile(args: argparse.Namespace) -> None:
    for name in args.transports:
        url = TRANSPORT_URLS[name]
        reason = unreachable_reason(url)
        if reason:
            print(f"\nprofile on {name} skipped: {reason}")
            continue
        for storage in reachable(args.storages):
            profile_run(url, storage, args.messages, confirm=args.confirm)


def _names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = sorted(set(names) - set(choices))
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=10_000, metavar="N",
                        help="PlaceOrder commands per run, for N distinct orders (aggregates); "
                             "2N messages are handled (10000)")
    parser.add_argument("--transports", type=_names(list(TRANSPORT_URLS)),
                        default=list(TRANSPORT_URLS), help="memory,amqp (both)")
    parser.add_argument("--storages", type=_names(list(idembus_flow.STORAGES)),
                        default=["default", "postgres"],
                        help="default (what Endpoint() uses), memory, mongomock, postgres; "
                             "the middleware variants run on default and postgres "
                             "(default,postgres)")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs per variant (3)")
    parser.add_argument("--no-confirms", dest="confirm", action="store_false",
                        help="publish without waiting for confirms, on both sides")
    parser.add_argument("--profile", action="store_true",
                        help="instead: run the idembus flow once under cProfile per transport "
                             "and storage and print the top 25 cumulative entries")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file ({RESULTS})")
    args = parser.parse_args(argv)
    if args.messages < 1 or args.rounds < 1:
        parser.error("--messages and --rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        profile(args)
        return 0
    report = bench(args)
    print()
    print(summary(report))
    write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
