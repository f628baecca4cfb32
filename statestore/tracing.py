"""OpenTelemetry traces, off unless the standard OTEL_* variables turn them on.

On when OTEL_TRACES_EXPORTER names an exporter (`otlp`, `console`) or an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT); OTEL_SDK_DISABLED=true keeps them off. Everything
else (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, the exporter's own variables) is read by the
OpenTelemetry SDK itself. The SDK is an optional extra (`pip install 'statestore[otel]'`).

Off, nothing here imports OpenTelemetry and the serving path is the same objects as without this module: the traced
wrappers (statestore/traced.py) are put in place at start-up only when tracing is on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

TRACER_NAME = "statestore"
SUPPORTED_EXPORTERS = ("otlp", "console")


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporters:
        return exporters != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def provider_from_environment(environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """A tracer provider exporting as the OTEL_* variables say, or None when they do not ask for traces. Raises
    RuntimeError with the remedy when they do and the SDK is missing or an exporter is unknown."""
    if not tracing_requested(environ):
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
    except ImportError as exc:
        raise RuntimeError(
            "OTEL_* variables ask for traces but the OpenTelemetry SDK is not installed: pip install 'statestore[otel]'"
        ) from exc
    names = [n.strip() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",") if n.strip()]
    unknown = [n for n in names if n not in SUPPORTED_EXPORTERS and n != "none"]
    if unknown:
        raise RuntimeError(f"OTEL_TRACES_EXPORTER: unsupported {', '.join(unknown)} (use otlp or console)")
    exporters: list[SpanExporter] = []
    if "otlp" in names:
        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol not in (None, "", "http/protobuf"):
            raise RuntimeError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: statestore exports OTLP over http/protobuf")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("the OTLP exporter is not installed: pip install 'statestore[otel]'") from exc
        exporters.append(OTLPSpanExporter())
    if "console" in names:
        exporters.append(ConsoleSpanExporter())
    # OTEL_SERVICE_NAME, else a service.name in OTEL_RESOURCE_ATTRIBUTES (Resource.create reads those), else ours.
    attributes: dict[str, str] = {}
    if name := environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = name
    elif "service.name=" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes["service.name"] = "statestore"
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider
