"""Chaos: SIGKILL a random worker every few seconds; restart the broker (RabbitMQ, or
PostgreSQL when the queues are in it) once."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class WorkerKiller:
    """A thread that SIGKILLs a random worker every ``interval`` seconds on average (the
    waits vary between half and one and a half times it). ``pids`` lists the workers."""

    def __init__(self, pids: Callable[[], list[int]], *, interval: float, seed: int) -> None:
        self.kills = 0
        self._pids = pids
        self._interval = interval
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-killer", daemon=True)

    def start(self) -> None:
        if self._interval > 0:
            self._thread.start()

    def stop(self) -> int:
        """Stop killing; return how many workers were killed."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.kills

    def _run(self) -> None:
        while not self._stop.wait(self._interval * self._rng.uniform(0.5, 1.5)):
            pids = self._pids()
            if not pids:
                continue
            victim = self._rng.choice(pids)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:  # it died on its own meanwhile
                continue
            self.kills += 1
            log.info("killed worker pid %d (kill %d)", victim, self.kills)


class BrokerControl(Protocol):
    """Stops and starts the broker: :class:`~samples.torture.rabbitmq.Rabbitmqctl`, or
    :class:`~samples.torture.postgres.PgCtlcluster` when the queues are in PostgreSQL."""

    def stop_app(self) -> None: ...

    def start_app(self) -> None: ...

    def await_startup(self) -> None: ...


class Disruption:
    """Something done to the broker once, halfway through the orders, in a thread of its
    own (:meth:`_run`, which sets ``_down`` once the broker is down and ``_finished`` at
    the end)."""

    def __init__(self, name: str) -> None:
        self.error: BaseException | None = None
        self._down = threading.Event()
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def begun(self) -> bool:
        return self._thread.ident is not None

    def begin(self) -> None:
        """Start it and return once the broker is down (or it failed)."""
        if self.begun:
            return
        self._thread.start()
        self._down.wait()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the broker is back; True if it finished."""
        return not self.begun or self._finished.wait(timeout)

    def _run(self) -> None:
        raise NotImplementedError


class BrokerRestart(Disruption):
    """Restarts the broker once, in a thread of its own: ``stop_app``, a pause of
    ``down_for`` seconds, ``start_app``, ``await_startup`` (RabbitMQ's application, or the
    PostgreSQL cluster). The broker is started again whatever happens (see also
    :meth:`ensure_up`)."""

    def __init__(self, rabbitmqctl: BrokerControl, *, down_for: float = 2.0) -> None:
        super().__init__("broker-restart")
        self.restarts = 0
        #: Seconds from stop_app to the end of await_startup.
        self.outage = 0.0
        self._ctl = rabbitmqctl
        self._down_for = down_for

    def ensure_up(self) -> None:
        """After an interrupted run: start the broker if a restart began and did not end
        well."""
        if self.begun and (not self._finished.is_set() or self.error is not None):
            log.warning("the broker restart did not finish; starting the broker")
            self._ctl.start_app()
            self._ctl.await_startup()

    def _run(self) -> None:
        stopped = False
        try:
            log.warning("restarting the broker: %s stop", type(self._ctl).__name__)
            began = time.monotonic()
            self._ctl.stop_app()
            stopped = True
            self._down.set()
            time.sleep(self._down_for)  # an outage of a few seconds, not a blip
        except BaseException as error:
            self.error = error
            log.error("rabbitmqctl stop_app failed: %s", error)
        finally:
            self._down.set()
            try:
                self._ctl.start_app()
                self._ctl.await_startup()
                if stopped:
                    self.restarts += 1
                    self.outage = time.monotonic() - began
                    log.warning("the broker is back after %.1fs", self.outage)
            except BaseException as error:
                self.error = error
                log.error("rabbitmqctl start_app failed: %s", error)
            finally:
                self._finished.set()
