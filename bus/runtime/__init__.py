"""What runs an endpoint: the second floor of ``idembus`` (this folder is ``bus/runtime/``).

The runtime builds on the foundation at the root of ``bus/`` and on the adapters
(``storage/``, ``transports/``, ``handlers/``); it imports nothing from ``cli/``,
``observability/`` or the apps (``dashboard/``, ``gateway/``, ``spark/``, ``testing/``).

* :mod:`.endpoint` — :class:`~idembus.Endpoint`, what users build and start;
* a delivery's walk: :mod:`.processing` (decode, expire, dedup, route to handlers) →
  :mod:`.invocation` (load, run the handler, commit) → :mod:`.dispatching` (send what was
  committed, then mark it sent) → the transport's ack; batched, :mod:`.batch_runner` runs a
  batch's messages side by side, and :mod:`.batching_ports` groups their loads, commits and
  dispatches;
* background work: :mod:`.outbox` (the relay that re-sends what a crash left unsent),
  :mod:`.scheduler`, :mod:`.status`, :mod:`.background`;
* :mod:`.recoverability` — retries, the circuit breaker, the error queue and parking.
"""
