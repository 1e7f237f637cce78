"""The dashboard: what an operator looks at — each endpoint's instances and an hour of
per-minute rates, the failed messages with retry and purge, the live and completed sagas of
a type and each one's story, and the event journal live.

``idembus dashboard package.module:endpoint... --listen 127.0.0.1:8043`` (or
:class:`Dashboard`) serves it; README, "The dashboard", says what each page shows and how it
is guarded.

Modules: :mod:`~idembus.dashboard.service` runs it (sampler, journal hubs, server);
:mod:`~idembus.dashboard.app` is the Starlette app; :mod:`~idembus.dashboard.security`
authentication, CSRF tokens and headers; :mod:`~idembus.dashboard.history` the per-minute
figures; :mod:`~idembus.dashboard.overview`, :mod:`~idembus.dashboard.failed`,
:mod:`~idembus.dashboard.aggregates` and :mod:`~idembus.dashboard.journal` the pages, built
with :mod:`~idembus.dashboard.html` (everything escaped unless written here),
:mod:`~idembus.dashboard.layout` and :mod:`~idembus.dashboard.charts` (SVG drawn on the
server); :mod:`~idembus.dashboard.lookup` reads one aggregate and
:mod:`~idembus.dashboard.saga_list` lists those of a type. ``static/`` holds the
stylesheet and the one script (refresh of the overview, the live stream), shipped with the
package.

The HTTP side needs Starlette and uvicorn (``pip install 'idembus[web]'``): they are
imported with :class:`Dashboard`, not with this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..gateway.extras import web_part

if TYPE_CHECKING:
    from .service import Dashboard

__all__ = ["Dashboard"]


def __getattr__(name: str) -> Any:
    if name != "Dashboard":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return web_part(f"{__name__}.service", "Dashboard", "the dashboard")
