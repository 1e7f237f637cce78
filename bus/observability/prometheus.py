"""Serving the metrics of this process to Prometheus (``idembus run --metrics-port N``).

An OpenTelemetry SDK meter provider whose reader is the OpenTelemetry Prometheus exporter,
in the Prometheus text format of ``prometheus_client``'s ASGI app at
``http://HOST:PORT/metrics`` (any path answers), with the process's own
``process_*``/``python_*`` series. Needs ``pip install 'idembus[prometheus]'``.

It listens on 127.0.0.1 unless told otherwise (``--metrics-host``), and is served by
uvicorn on one asyncio thread of its own (:class:`~idembus.gateway.serving.ServedApp`, as
the gateway's; uvicorn comes with the prometheus extra, Starlette is not needed): idle
connections cost no thread, at most ``max_connections`` are held (beyond, the one idle the
longest is closed: a scrape always gets through), and each must send its request within
``idle_timeout`` seconds — so idle sockets can neither exhaust the worker's descriptors nor
keep Prometheus out.

Under ``--workers`` each worker writes what this would serve to a file
(:mod:`.metrics_snapshots`) and the supervisor serves their sum (:mod:`.metrics_group`).
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from ..gateway.serving import ServedApp

log = logging.getLogger(__name__)

#: Connections the metrics endpoint holds at once (Prometheus needs one or two).
MAX_CONNECTIONS = 16
#: Seconds a connection to the metrics endpoint may take to send its request.
IDLE_TIMEOUT = 10.0
#: Seconds :meth:`MetricsServer.stop` lets a scrape in progress finish.
STOP_TIMEOUT = 5.0


class MetricsServer:
    """A meter provider and the HTTP server that shows it, until :meth:`stop`.

    ``port`` 0 takes a free port (:attr:`port` tells which). ``service_name`` becomes the
    ``service.name`` of the provider's resource (the ``target_info`` series), unless
    ``OTEL_SERVICE_NAME`` says otherwise. ``max_connections`` and ``idle_timeout``: see the
    module docstring.
    """

    def __init__(self, port: int, host: str = "127.0.0.1", *,
                 service_name: str | None = None, max_connections: int = MAX_CONNECTIONS,
                 idle_timeout: float = IDLE_TIMEOUT) -> None:
        check_port(port)
        try:
            from prometheus_client import REGISTRY
        except ImportError as missing:
            raise missing_extra(missing) from missing
        #: The provider whose instruments the server shows.
        self.meter_provider = prometheus_meter_provider(service_name)
        try:
            self._served = serve_registry(REGISTRY, host, port,
                                          max_connections=max_connections,
                                          idle_timeout=idle_timeout)
        except ConfigurationError:
            self.meter_provider.shutdown()
            raise
        self.host = host
        self._stopped = False
        log.info("serving metrics for Prometheus at %s/metrics", self._served.url)

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return self._served.address[1]

    @property
    def open_connections(self) -> int:
        """Connections held now."""
        return self._served.open_connections

    def stop(self) -> None:
        """Stop serving, and shut the meter provider down (once; later calls do nothing)."""
        if self._stopped:
            return
        self._stopped = True
        self._served.stop(STOP_TIMEOUT)
        self.meter_provider.shutdown()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def serve_endpoint_metrics(endpoint: Any, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``endpoint``'s metrics: the server's provider becomes the process's global
    meter provider, which a :class:`~idembus.observability.metrics.Metrics` middleware created
    without a provider uses. An endpoint without one is given one
    (:meth:`Endpoint.add_middleware`)."""
    server = MetricsServer(port, host, service_name=endpoint.name)  # checks the extra
    measure_endpoint(endpoint, server.meter_provider, "--metrics-port")
    return server


def prometheus_meter_provider(service_name: str | None = None) -> Any:
    """An OpenTelemetry SDK meter provider read by the OpenTelemetry Prometheus exporter,
    whose collector joins prometheus_client's default registry (and so the process's
    ``generate_latest()``). ``service_name`` becomes the ``service.name`` of its resource
    (the ``target_info`` series), unless ``OTEL_SERVICE_NAME`` says otherwise."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.resources import Resource
    except ImportError as missing:
        raise missing_extra(missing) from missing
    attributes = {"service.name": service_name} if service_name else {}
    return MeterProvider(metric_readers=[PrometheusMetricReader()],
                         resource=Resource.create(attributes))


def measure_endpoint(endpoint: Any, meter_provider: Any, option: str) -> None:
    """Make ``meter_provider`` the process's global meter provider and give ``endpoint`` a
    :class:`~idembus.observability.metrics.Metrics` middleware if it has none; warn (naming
    ``option``) where the endpoint's metrics would go elsewhere."""
    from opentelemetry import metrics as otel_metrics

    from .metrics import Metrics

    otel_metrics.set_meter_provider(meter_provider)
    if otel_metrics.get_meter_provider() is not meter_provider:
        log.warning("the process has a global meter provider already: the endpoint's "
                    "metrics go there, and %s shows only the process's own", option)
    present = [item for item in endpoint.pipeline.middleware if isinstance(item, Metrics)]
    if not present:
        endpoint.add_middleware(Metrics(meter_provider=meter_provider))
    elif any(item.meter_provider is not None for item in present):
        log.warning("the Metrics middleware of endpoint %s has a meter provider of its own: "
                    "%s does not show it", endpoint.name, option)


def serve_registry(registry: Any, host: str, port: int, *,
                   max_connections: int = MAX_CONNECTIONS,
                   idle_timeout: float = IDLE_TIMEOUT) -> ServedApp:
    """prometheus_client's ASGI app of ``registry``, served and started on ``host:port``
    (a :class:`~idembus.gateway.serving.ServedApp`; see the module docstring); a port that
    cannot be had is a :class:`~idembus.errors.ConfigurationError` that names it."""
    check_port(port)
    try:
        from prometheus_client import make_asgi_app

        from ..gateway.serving import ServedApp
    except ImportError as missing:
        raise missing_extra(missing) from missing
    served = ServedApp(make_asgi_app(registry), host=host, port=port,
                       idle_timeout=idle_timeout, name="idembus-metrics",
                       max_connections=max_connections)
    try:
        served.start()
    except ConfigurationError as error:
        raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {error}") from error
    return served


def check_port(port: int) -> None:
    """Refuse a port outside 0..65535 (0: a free one)."""
    if not 0 <= port <= 65535:
        raise ConfigurationError(f"--metrics-port must be within 0..65535, got {port}")


def missing_extra(missing: ImportError) -> ConfigurationError:
    """The error saying which extra to install."""
    return ConfigurationError(
        f"serving metrics to Prometheus needs the prometheus extra: pip install "
        f"'idembus[prometheus]' ({missing})")
