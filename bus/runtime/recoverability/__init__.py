"""What happens when a message fails (``bus/runtime/recoverability/``); the headers a
failed message carries are part of the wire format (:mod:`idembus.failures`).

* :mod:`.policy` — :class:`~idembus.Recoverability`: immediate and delayed retries, then the
  error queue; the circuit breaker's pause when failures look like an outage;
* :mod:`.breaker` — the circuit breaker itself;
* :mod:`.time_limits` — handlers past their time limit abandoned or cancelled, stuck threads
  and the process recycled, hung handlers in the status reports;
* :mod:`.parking` — failed messages kept in the storage when the broker refuses them;
* :mod:`.error_queue` — reading, retrying and purging failed messages (the CLI and the
  dashboard share it).
"""
