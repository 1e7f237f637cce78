"""The broker as the torture run sees it from outside: queue depths and consumers, and
``rabbitmqctl`` to stop and start the RabbitMQ application."""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass

import kombu

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueStatus:
    """A queue as the broker reports it to a passive declare."""

    #: Messages ready for delivery (not counting the unacknowledged ones).
    messages: int
    consumers: int


class QueueProbe:
    """Asks the broker about queues, on a fresh connection per question (the broker may
    have been restarted since the last one)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def status(self, queues: list[str]) -> dict[str, QueueStatus]:
        """Status of each queue that exists; raises the driver's error if the broker cannot
        be reached."""
        found = {}
        with kombu.Connection(self.url, connect_timeout=5) as connection:
            for queue in queues:
                channel = connection.channel()
                try:
                    _, messages, consumers = channel.queue_declare(queue=queue, passive=True)
                except connection.channel_errors:
                    continue  # the queue does not exist (the broker closed the channel)
                finally:
                    _close_quietly(channel)
                found[queue] = QueueStatus(int(messages), int(consumers))
        return found


def _close_quietly(channel: object) -> None:
    try:
        channel.close()  # type: ignore[attr-defined]
    except Exception:  # a channel the broker closed may fail to close again
        log.debug("closing a channel failed", exc_info=True)


class Rabbitmqctl:
    """Runs ``rabbitmqctl`` on the broker's node (needs its Erlang cookie: root or the
    rabbitmq user)."""

    def __init__(self, command: str = "rabbitmqctl", *, timeout: float = 120.0) -> None:
        self.command = command
        self.timeout = timeout

    def stop_app(self) -> None:
        """Stop the RabbitMQ application; connections are closed, the node stays up."""
        self._run("stop_app")

    def start_app(self) -> None:
        """Start the RabbitMQ application (nothing happens if it runs)."""
        self._run("start_app")

    def await_startup(self) -> None:
        """Wait until the application has started and accepts connections."""
        self._run("await_startup")

    def usable(self) -> bool:
        """True if ``rabbitmqctl`` can talk to the node."""
        try:
            self._run("status")
        except (OSError, subprocess.SubprocessError):
            return False
        return True

    def _run(self, action: str) -> None:
        # A session of its own: a signal to the caller's process group (Ctrl-C, a test's
        # killpg) must not kill start_app halfway and leave the broker down.
        done = subprocess.run([self.command, "-q", action], capture_output=True, text=True,
                              timeout=self.timeout, start_new_session=True)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout,
                                                done.stderr)
        log.log(logging.DEBUG if action == "status" else logging.INFO, "rabbitmqctl %s done",
                action)
