"""The event gateway: the event journal as a resumable Server-Sent Events stream.

``idembus gateway package.module:endpoint --listen 127.0.0.1:8042`` (or :class:`Gateway`)
serves ``GET /`` with ``Accept: text/event-stream``, ``GET /status`` and ``GET /healthz``.
See README, "The event stream", for the protocol: ids are journal positions,
``Last-Event-ID`` resumes, ``0`` or a millisecond timestamp asks for full replication,
``types=`` and ``parents=`` filter.

Modules: :mod:`~idembus.gateway.hub` follows the journal and fans new entries out to clients;
:mod:`~idembus.gateway.encoded` encodes each entry once for all of them;
:mod:`~idembus.gateway.request` reads a client's request (resume point, filters);
:mod:`~idembus.gateway.stream` produces one client's stream; :mod:`~idembus.gateway.server` is the
HTTP API (a Starlette app), :mod:`~idembus.gateway.response` the streaming response,
:mod:`~idembus.gateway.auth` its credentials; :mod:`~idembus.gateway.service` serves it with uvicorn
(:mod:`~idembus.gateway.protocol`: per-connection timeouts); :mod:`~idembus.gateway.sse` formats
events.

The HTTP side needs Starlette and uvicorn (``pip install 'idembus[web]'``): they are
imported with :class:`Gateway`, not with this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .extras import web_part

if TYPE_CHECKING:
    from .service import Gateway

__all__ = ["Gateway"]


def __getattr__(name: str) -> Any:
    if name != "Gateway":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return web_part(f"{__name__}.service", "Gateway", "the event gateway")
