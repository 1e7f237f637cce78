"""What middleware, tracing and async handlers cost per message, in CPU instructions.

The machine these benchmarks run on is shared, and wall-clock rates vary by a quarter from
one round to the next; an instruction count does not. ``python -m bench.instructions``
runs itself under ``valgrind --tool=callgrind`` twice per variant, with N and 2N messages,
and reports ``(instructions(2N) - instructions(N)) / N``: the cost of one message, with
interpreter start-up, imports, connections and warm-up cancelled out. Where the messages
are queued through ``endpoint.bus`` before the clock of the wall-clock benchmark starts,
that queueing is counted the same way in runs that only queue, and subtracted.

Drivers (``--drivers``) and their variants:

``pipeline``
    One delivery through the pipeline's stages as the endpoint runs them, with no
    transport and no storage: ``message`` around ``handler`` around ``commit``, one
    message recorded through the ``outgoing`` hooks inside the handler stage, then
    dispatched through the ``dispatch`` stage: the middleware's own work. Variants:
    ``none``; ``noop5`` (five middleware overriding every hook with nothing);
    ``tracing`` (every trace recorded, on an SDK provider whose exporter drops the spans,
    as in :mod:`bench.middleware_cost`); ``tracing_sampled`` (one message in ten arrives
    in a recorded trace, under ``ParentBased(TraceIdRatioBased(0.1))``);
    ``tracing_unsampled`` (none does); ``sdk_floor`` (no middleware: the four spans a
    traced message makes — process, handle, commit, send — started and ended directly on
    the same SDK provider, with the attributes ``Tracing`` gives them and the same
    parents: what the OpenTelemetry SDK itself costs, the floor under four spans).
``flow``
    :mod:`bench.idembus_flow` (Sales and Billing, two messages handled per order), per
    handled message: the whole of idembus's work in the process, with the middleware
    variants ``none``, ``noop5``, ``tracing``, ``tracing_sampled`` (as
    :mod:`bench.throughput` runs them).
``async``
    :mod:`bench.async_handlers`, per handled message: ``sync``, ``async``,
    ``async_await``.

Both run on memory:// with MemoryStorage unless ``--transport amqp`` (RabbitMQ at
``IDEMBUS_AMQP_URL``) and ``--storage postgres`` (``IDEMBUS_POSTGRES_URL``) say otherwise;
the broker's and the database's own work is not counted, only this process's.

Each table gives the instructions per message, the difference from the driver's first
variant, and that variant's count over this one's: the throughput ratio the variant would
have if the CPU were all that counted (waiting for a broker or a database is not in it).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from bench import middleware_cost
from bench.common import TRANSPORT_URLS
from bench.idembus_flow import STORAGES

#: driver -> its variants, the first being the one the others are compared with.
VARIANTS: dict[str, tuple[str, ...]] = {
    "pipeline": ("none", "noop5", "tracing", "tracing_sampled", "tracing_unsampled",
                 "sdk_floor"),
    "flow": ("none", "noop5", "tracing", "tracing_sampled"),
    "async": ("sync", "async", "async_await"),
}
#: Messages handled per unit counted (the flow handles an order twice: Sales, Billing).
HANDLED_PER_UNIT = {"pipeline": 1, "flow": 2, "async": 1}
#: The least rate (messages/s) of a run under callgrind that is not broken: callgrind runs
#: Python some 50 times slower, on a machine that may be busy (a flow of 600 messages has
#: taken more than the 60 s a wall-clock run is given); the wait grows with the messages.
CALLGRIND_LEAST_RATE = 1.0


def _middleware(variant: str) -> Callable[[], list[Any]]:
    return {"none": middleware_cost.none, "noop5": middleware_cost.five_no_ops,
            "tracing": middleware_cost.tracing,
            "tracing_sampled": middleware_cost.tracing_sampled,
            "tracing_unsampled": middleware_cost.tracing_sampled}[variant]


# -- the drivers, run inside callgrind -------------------------------------------------------


def run_pipeline(variant: str, count: int) -> None:
    """``count`` deliveries through the pipeline's stages (see the module docstring); each
    arrives with a W3C ``traceparent`` whose sampled flag is on for every message, for one
    in ten (``tracing_sampled``) or for none (``tracing_unsampled``)."""
    from idembus import headers as h
    from idembus.context import MessageContext
    from idembus.envelope import Envelope
    from idembus.pipeline import Dispatch, HandlerCall, IncomingMessage, Pipeline
    from samples.ordering.messages import PlaceOrder

    floor = _sdk_floor() if variant == "sdk_floor" else None
    pipeline = Pipeline(_middleware(variant)() if floor is None else [])
    message = PlaceOrder(order_id="order-1", customer="c", amount_cents=100)
    for index in range(count):
        sampled = {"tracing_sampled": index % 10 == 0,
                   "tracing_unsampled": False}.get(variant, True)
        headers = {h.MESSAGE_ID: str(uuid.UUID(int=index + 1)), h.MESSAGE_TYPE: "PlaceOrder",
                   h.CONVERSATION_ID: "conv-1",
                   "traceparent": f"00-{index + 1:032x}-{index + 1:016x}-"
                                  f"{'01' if sampled else '00'}"}
        if floor is not None:
            floor(headers)
            continue
        incoming = IncomingMessage("sales", "sales", headers)
        context = MessageContext(message_id=headers[h.MESSAGE_ID], message_type="PlaceOrder",
                                 headers=headers, handler_name="OrderHandler",
                                 endpoint="sales")
        outgoing = Envelope(headers={h.MESSAGE_ID: str(uuid.UUID(int=10**9 + index)),
                                     h.MESSAGE_TYPE: "OrderPlaced", h.INTENT: "publish",
                                     h.CONVERSATION_ID: "conv-1",
                                     h.ORIGINATING_ENDPOINT: "sales"}, body="{}")

        def process(incoming: IncomingMessage = incoming, context: MessageContext = context,
                    outgoing: Envelope = outgoing) -> None:
            call = HandlerCall(incoming, context, message, 1)
            recorded: list[Envelope] = []

            def attempt() -> None:
                recorded.append(pipeline.prepare(outgoing, context))
                call.outgoing = tuple(recorded)
                pipeline.commit(call, lambda: None)

            pipeline.handler(call, attempt)
            for envelope in recorded:
                pipeline.dispatch(Dispatch(envelope, "sales", "handler"), lambda: None)
            incoming.outcome = "handled"

        pipeline.message(incoming, process)


def _sdk_floor() -> Callable[[dict[str, str]], None]:
    """Four spans per message straight on the SDK (what ``Tracing`` makes, nothing else)."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

    [tracing] = middleware_cost.tracing()
    tracer = tracing._tracer  # the same provider and processor as the tracing variant

    def four_spans(headers: dict[str, str]) -> None:
        _, trace_id, span_id, _ = headers["traceparent"].split("-")
        parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            int(trace_id, 16), int(span_id, 16), is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        message_id = headers["idembus.message_id"]
        process = tracer.start_span("process sales", parent, SpanKind.CONSUMER, attributes={
            "messaging.system": "memory", "messaging.operation.type": "process",
            "messaging.operation.name": "process", "messaging.destination.name": "sales",
            "idembus.endpoint": "sales", "messaging.message.id": message_id,
            "messaging.message.conversation_id": "conv-1",
            "idembus.message_type": "PlaceOrder"})
        in_process = trace.set_span_in_context(process)
        handle = tracer.start_span("handle OrderHandler", in_process, attributes={
            "idembus.handler": "OrderHandler", "idembus.attempt": 1,
            "messaging.message.id": message_id,
            "messaging.message.conversation_id": "conv-1"})
        in_handle = trace.set_span_in_context(handle)
        tracer.start_span("commit OrderHandler", in_handle).end()
        handle.set_attributes({"idembus.duplicate": False, "idembus.outgoing": 1})
        handle.end()
        tracer.start_span("publish OrderPlaced", in_handle, SpanKind.PRODUCER, attributes={
            "messaging.system": "memory", "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": "OrderPlaced", "idembus.dispatch.source": "handler",
            "idembus.redispatched": False, "messaging.message.id": "out",
            "messaging.message.conversation_id": "conv-1"}).end()
        process.set_attribute("idembus.outcome", "handled")
        process.end()

    return four_spans


def run_flow(variant: str, count: int, url: str, storage: str, *,
             queue_only: bool = False) -> None:
    """``count`` orders through :mod:`bench.idembus_flow`; with ``queue_only``, only what
    happens before its clock starts (building the endpoints, queueing the orders through
    ``sales.bus``, traced too) and the clean-up."""
    from bench import idembus_flow

    if not queue_only:
        idembus_flow.run(url, storage, count, middleware=_middleware(variant),
                         least_rate=CALLGRIND_LEAST_RATE)
        return
    flow = idembus_flow.build_flow(url, storage, count, confirm=True,
                                   middleware=_middleware(variant))
    try:
        idembus_flow.preload(flow, count)
    finally:
        for each in flow.endpoints:
            each.close()
        idembus_flow.cleanup(flow)


def run_async(variant: str, count: int, url: str, storage: str, *,
              queue_only: bool = False) -> None:
    """``count`` orders through :mod:`bench.async_handlers` (with ``queue_only``, as
    :func:`run_flow`)."""
    from bench import async_handlers

    logging.getLogger("idembus.runtime.endpoint").setLevel(logging.ERROR)
    handler = async_handlers.VARIANTS[variant][1]
    if not queue_only:
        async_handlers.run(url, storage, handler, count, least_rate=CALLGRIND_LEAST_RATE)
        return
    orders = async_handlers.build(url, storage, handler, count)
    try:
        async_handlers.preload(orders, count)
    finally:
        async_handlers.cleanup(orders)


# -- counting instructions ----------------------------------------------------------------


def instructions(driver: str, variant: str, count: int, *, transport: str = "memory",
                 storage: str = "memory", queue_only: bool = False) -> int:
    """Instructions callgrind counts for one run of ``driver`` with ``count`` messages (or
    orders), interpreter start-up included."""
    with tempfile.TemporaryDirectory() as where:
        out = os.path.join(where, "callgrind.out")
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                   sys.executable, "-m", "bench.instructions", "--inside", driver, variant,
                   str(count), transport, storage, *(["--queue-only"] if queue_only else [])]
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            raise SystemExit(f"callgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
        match = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
        if match is None:
            raise SystemExit(f"no instruction count in callgrind's output:\n{done.stderr[-3000:]}")
        return int(match.group(1))


def per_message(driver: str, variant: str, count: int, **where: str) -> float:
    """Instructions per handled message: the difference between runs of 2 x ``count`` and
    ``count``, less the same difference of queueing them (flow and async), over the
    messages handled in between. ``where``: ``transport`` and ``storage``."""
    handled = (instructions(driver, variant, 2 * count, **where)
               - instructions(driver, variant, count, **where))
    if driver != "pipeline":
        handled -= (instructions(driver, variant, 2 * count, queue_only=True, **where)
                    - instructions(driver, variant, count, queue_only=True, **where))
    return handled / (count * HANDLED_PER_UNIT[driver])


def _inside(argv: list[str]) -> None:
    driver, variant, count, transport, storage = argv[:5]
    if driver == "pipeline":
        run_pipeline(variant, int(count))
    else:
        (run_flow if driver == "flow" else run_async)(
            variant, int(count), TRANSPORT_URLS[transport], storage,
            queue_only="--queue-only" in argv)


def _names(text: str, choices: Sequence[str]) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(choices))
    if unknown:
        raise SystemExit(f"unknown {', '.join(unknown)}: choose from {', '.join(choices)}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--inside"]:
        _inside(arguments[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.instructions",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--drivers", default="pipeline,flow,async",
                        help="pipeline,flow,async (all)")
    parser.add_argument("--variants", default=None,
                        help="those to run, by name (default: every variant of each driver)")
    parser.add_argument("--messages", type=int, default=300,
                        help="messages (pipeline) or orders (flow, async) of the smaller run "
                             "(300)")
    parser.add_argument("--transport", choices=sorted(TRANSPORT_URLS), default="memory",
                        help="of the flow and async drivers (memory)")
    parser.add_argument("--storage", choices=sorted(STORAGES), default="memory",
                        help="of the flow and async drivers (memory)")
    args = parser.parse_args(arguments)
    where = {"transport": args.transport, "storage": args.storage}
    drivers = _names(args.drivers, list(VARIANTS))
    wanted = None if args.variants is None else set(
        _names(args.variants, sorted({v for vs in VARIANTS.values() for v in vs})))
    fields: list[str] = []
    for driver in drivers:
        chosen = [v for v in VARIANTS[driver] if wanted is None or v in wanted]
        base_name = VARIANTS[driver][0]
        on = "" if driver == "pipeline" else f" on {args.transport} + {args.storage}"
        print(f"\n{driver}{on}: instructions per handled message (callgrind, {args.messages} "
              f"and {2 * args.messages} {'messages' if driver == 'pipeline' else 'orders'})")
        print(f"{'variant':<20} {'instructions':>13} {'vs ' + base_name:>13} "
              f"{base_name + '/variant':>14}")
        base: float | None = None
        for variant in chosen:
            cost = per_message(driver, variant, args.messages, **where)
            base = cost if variant == base_name else base
            difference = f"{cost - base:>+13,.0f}" if base is not None else f"{'':>13}"
            ratio = f"{base / cost:>14.3f}" if base is not None else f"{'':>14}"
            print(f"{variant:<20} {cost:>13,.0f} {difference} {ratio}", flush=True)
            place = "" if driver == "pipeline" or where == {"transport": "memory",
                                                            "storage": "memory"} else (
                f"_{args.transport}_{args.storage}")
            fields.append(f"{driver}{place}_{variant}={cost:.0f}")
    print("\ninstructions: " + " ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
