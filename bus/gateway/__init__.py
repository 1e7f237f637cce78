"""The event gateway: the event journal as a resumable Server-Sent Events stream.

``idembus gateway package.module:endpoint --listen 127.0.0.1:8042`` (or :class:`Gateway`)
serves ``GET /`` with ``Accept: text/event-stream`` and ``GET /status``. See README, "The
event stream", for the protocol: ids are journal positions, ``Last-Event-ID`` resumes,
``0`` or a millisecond timestamp asks for full replication, ``types=`` and ``parents=``
filter.

Modules: :mod:`~bus.gateway.hub` follows the journal and fans new entries out to clients;
:mod:`~bus.gateway.request` reads a client's request (resume point, filters);
:mod:`~bus.gateway.stream` writes one client's stream; :mod:`~bus.gateway.server` is the
HTTP server; :mod:`~bus.gateway.sse` formats events.
"""

from .server import Gateway

__all__ = ["Gateway"]
