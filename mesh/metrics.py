"""One instance's metrics: OpenTelemetry instruments, read by a Prometheus exporter that serves them as
text on the instance's own port (`http://HOST:PORT/metrics`, published in the registry as `metrics_url`),
and pushed where `--metrics` says too (console, OTLP, a JSON-lines file).

Instrument names are Prometheus' already (`infermesh_*`): the exporter adds `_total` to counters and the
unit (`_seconds`, `_bytes`) to the rest. Each instance has a registry of its own, so instances that share a
process (tests) never mix their series. Histograms of seconds and of tokens get buckets that fit them.
"""

from __future__ import annotations

import urllib.request
from typing import Callable

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from mesh.telemetry import push_metrics_reader

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
           20.0, 40.0, 80.0)
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


ENGINE_LOAD = {  # the gauges of an instance that runs an engine (prefill, decode), keys of EngineCore.load()
    "requests_running": "Requests in the running batch",
    "requests_waiting": "Requests queued for their (first or next) prefill chunk",
    "kv_blocks_used": "KV cache blocks held by requests (the prefix cache's free blocks not counted)",
    "kv_blocks_total": "KV cache blocks of this instance (per rank)",
}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """One Prometheus scrape: (sample name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as (sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class Metrics:
    def __init__(self, service: str, push: str = "none", interval_s: float = 10.0) -> None:
        """`push`: the `--metrics` spec (none | console | otlp | file:PATH), pushed every `interval_s`."""
        self._registry = CollectorRegistry()
        readers = [PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=self._registry)]
        if (reader := push_metrics_reader(push, interval_s)) is not None:
            readers.append(reader)
        self.provider = MeterProvider(metric_readers=readers, resource=Resource.create({"service.name": service}))
        self.meter: Meter = self.provider.get_meter("infermesh")
        self.url, self._server, self._shut = "", None, False

    def serve(self, host: str, port: int | None, bind_host: str = "") -> None:
        """Serve Prometheus text on port (0: any free one; None: nowhere), listening on `bind_host` ("": host),
        published as reachable at `host`."""
        if port is not None:
            self._server, _ = start_http_server(port, addr=bind_host or host, registry=self._registry)
            self.url = f"http://{host}:{self._server.server_port}/metrics"

    def samples(self) -> dict[tuple[str, tuple], float]:
        """What a scrape of these metrics reads now, without HTTP."""
        return parse(generate_latest(self._registry).decode())

    def counter(self, name: str, unit: str, description: str, zeros: tuple[dict, ...] = ({},)):
        """A counter, exported at 0 for each label set of `zeros` before it first counts (so a scrape sees it)."""
        counter = self.meter.create_counter(name, unit=unit, description=description)
        for labels in zeros:
            counter.add(0, labels)
        return counter

    def counted(self, name: str, unit: str, description: str, read: Callable[[], int]) -> None:
        """A counter whose total `read()` returns, read at each collection."""
        self.meter.create_observable_counter(name, unit=unit, description=description,
                                            callbacks=[lambda _: [Observation(read())]])

    def seconds(self, name: str, description: str):
        return self.meter.create_histogram(name, unit="s", description=description,
                                           explicit_bucket_boundaries_advisory=SECONDS)

    def tokens(self, name: str, description: str):
        return self.meter.create_histogram(name, unit="{token}", description=description,
                                           explicit_bucket_boundaries_advisory=TOKENS)

    def gauges(self, read: Callable[[], dict[str, int]], descriptions: dict[str, str]) -> None:
        """One gauge `infermesh_<key>` per key of `read()`, read at each collection."""
        for key, description in descriptions.items():
            self.meter.create_observable_gauge(f"infermesh_{key}", description=description,
                                               callbacks=[lambda _, k=key: [Observation(read()[k])]])

    def shutdown(self) -> None:
        """A last push, then stop serving; safe twice."""
        if self._shut:
            return
        self._shut = True
        self.provider.shutdown()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
