"""The data pipeline on Spark (the ``[spark]`` extra): bulk work through the same handlers
with the same guarantee as live traffic.

* :mod:`idembus.spark.replay` — feed a DataFrame of messages (an archive, a backfill, the error
  queue's export) through an endpoint's handlers, and a ``foreachBatch`` sink for
  Structured Streaming. Spark re-executes tasks; the storage's deduplication makes a
  re-executed task apply nothing twice.
* :mod:`idembus.spark.source` — a Python data source reading the audit trail from the storage.
* :mod:`idembus.spark.report` — per message type and endpoint: counts, duplicates,
  redispatches, failures, latency percentiles; a table and a PNG chart.
* :mod:`idembus.spark.reconcile` — compare the stored aggregates with a dump of the source
  data and publish and journal an ``idembus.Reconciled`` event per difference (missing,
  stale, deleted).

Nothing in ``bus``, ``handlers``, ``storage`` or ``transports`` imports this package.
"""
