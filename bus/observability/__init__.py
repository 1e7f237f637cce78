"""Watching the bus from outside (``bus/observability/``): OpenTelemetry tracing and
metrics, the Prometheus endpoint and the audit trail.

These are middleware and helpers that an application adds to an endpoint; the runtime
never imports them. They need the ``otel`` or ``prometheus`` extra.
"""
