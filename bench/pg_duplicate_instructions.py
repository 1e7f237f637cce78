"""Instructions a fresh message and a duplicate cost ``bench.postgres``'s idembus worker.

``python -m bench.pg_duplicate_instructions [--messages N] [--batch B]``: the endpoint of
:mod:`bench.pg_handlers` (RabbitMQ at ``IDEMBUS_AMQP_URL``, PostgreSQL at
``IDEMBUS_POSTGRES_URL``, one consumer thread, batches of ``B``) handles ``N`` fresh
messages in a process under ``valgrind --tool=callgrind``, then the same messages again
(same ids, their events confirmed and compacted: :mod:`bench.pg_duplicates`) in a second
one; then the same with ``2N``. The differences over ``N`` are one fresh message's and one
duplicate's instructions in the worker: start-up, imports, connections and stop cancel
out; the broker's and the database's own work is not counted. The timed duplicate path of
``bench.postgres --parts duplicates`` is the same work on two processes of two threads.

Each run checks what it was meant to do: every message handled once, then found a
duplicate, counters and processed records unchanged, no event sent again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict

from bench.pg_common import RunNames
from bench.pg_handlers import build_endpoint
from bench.pg_idembus import IdembusVariant, preload, totals
from bench.pg_topology import Broker, Cleanup

#: How long a run under callgrind may take before it counts as stalled.
TIMEOUT = 1200.0


def _run(names: RunNames, count: int, counter: str, batch: int) -> None:
    """In this process: the endpoint runs until its ``counter`` reaches ``count``."""
    endpoint = build_endpoint(names, concurrency=1, batch=batch)
    done = threading.Event()
    seen = [0]

    def one_more(sender: object, **_: object) -> None:  # the consumer thread's alone
        seen[0] += 1
        if seen[0] == count:
            done.set()

    getattr(endpoint.signals, counter).connect(one_more, weak=False)
    thread = threading.Thread(target=endpoint.run, daemon=True)
    thread.start()
    finished = done.wait(TIMEOUT)
    endpoint.stop()
    thread.join(TIMEOUT)
    endpoint.close()
    counts = endpoint.counters.snapshot()
    if not finished or counts[counter] != count or counts["received"] != count:
        raise SystemExit(f"expected {count} {counter}, counted {counts}")


def _instructions(names: RunNames, count: int, counter: str, batch: int) -> int:
    with tempfile.TemporaryDirectory() as where:
        out = os.path.join(where, "callgrind.out")
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             "-m", "bench.pg_duplicate_instructions", "--inside", json.dumps(asdict(names)),
             str(count), counter, str(batch)],
            capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
            check=False)
    match = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode != 0 or match is None:
        raise SystemExit(f"callgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return int(match.group(1))


def measure(count: int, batch: int) -> tuple[int, int]:
    """Instructions of the fresh run and of the duplicate run of ``count`` messages."""
    names = RunNames.fresh()
    cleanup = Cleanup(names)
    broker = Broker(names.amqp_url)
    try:
        broker.declare_sink(names)
        IdembusVariant().prepare(names, broker, cleanup, count)
        fresh = _instructions(names, count, "handled", batch)
        before = totals(names)
        preload(broker, names, range(count))
        duplicate = _instructions(names, count, "duplicate", batch)
        after = totals(names)
        events = broker.depth(names.sink_queue)
        if before != after or before[:2] != (count, count) or events != count:
            raise SystemExit(f"duplicates had effects: {before} -> {after}, {events} events")
        return fresh, duplicate
    finally:
        broker.close()
        cleanup.run()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--inside"]:
        _run(RunNames(**json.loads(argv[1])), int(argv[2]), argv[3], int(argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300, help="N (300)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (32)")
    args = parser.parse_args(argv)
    fresh_n, duplicate_n = measure(args.messages, args.batch)
    fresh_2n, duplicate_2n = measure(2 * args.messages, args.batch)
    fresh = (fresh_2n - fresh_n) / args.messages
    duplicate = (duplicate_2n - duplicate_n) / args.messages
    print(f"instructions: fresh={fresh:.0f} duplicate={duplicate:.0f} "
          f"fresh_over_duplicate={fresh / duplicate:.3f} "
          f"(RabbitMQ + PostgreSQL, 1 thread, batch {args.batch}, {args.messages} and "
          f"{2 * args.messages} messages)")


if __name__ == "__main__":
    main(sys.argv[1:])
