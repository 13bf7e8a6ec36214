"""The chart's dashboard and alerts query what a mesh exports: every metric name in every panel of
dashboards/infermesh.json and in every alert of the PrometheusRule is a series that a running mesh
(`infermesh up` with expert instances, a KV pool and traffic through every path) serves on its
instances' metrics ports, or kube-state-metrics' restart counter. And both render as their consumers
expect: a ConfigMap with Grafana's sidecar label, a PrometheusRule whose alerts each have an expression,
a severity and a summary."""

from __future__ import annotations

import json
import re

import pytest
import torch

from mesh.metrics import scrape
from tests.conftest import TINY_VOCAB
from tests.test_helm import OBSERVABILITY, render
from tests.test_mesh_processes import cli, start_mesh, started, stop_mesh
from tests.test_router import generate

pytestmark = pytest.mark.slow  # a whole mesh of processes

METRIC = re.compile(r"\b((?:infermesh|kube)_[a-z0-9_]+)\b")
KUBE_STATE_METRICS = {"kube_pod_container_status_restarts_total"}  # not ours: the cluster's


def queries() -> dict[str, str]:
    """Every PromQL expression of the rendered dashboard and alerts, by where it is."""
    rendered = render(*OBSERVABILITY)
    dashboard = json.loads(rendered["ConfigMap", "mesh-dashboard"]["data"]["infermesh.json"])
    found = {f"panel {p['title']!r} {t['refId']}": t["expr"] for p in dashboard["panels"] for t in p["targets"]}
    for group in rendered["PrometheusRule", "mesh"]["spec"]["groups"]:
        found.update({f"alert {rule['alert']}": rule["expr"] for rule in group["rules"]})
    return found


def test_the_dashboard_and_alerts_render_as_grafana_and_the_prometheus_operator_expect():
    rendered = render(*OBSERVABILITY)
    config_map = rendered["ConfigMap", "mesh-dashboard"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["infermesh.json"])
    assert dashboard["uid"] == "infermesh" and len(dashboard["panels"]) >= 12
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    rule = rendered["PrometheusRule", "mesh"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    (group,) = rule["spec"]["groups"]
    assert {r["alert"] for r in group["rules"]} == {
        "InfermeshTTFTOverSLO", "InfermeshTPOTOverSLO", "InfermeshKVCacheNearlyFull", "InfermeshMigrationsRising",
        "InfermeshKVTransferFailing", "InfermeshInstanceRestarting"}
    assert all(r["expr"] and r["labels"]["severity"] and r["annotations"]["summary"] for r in group["rules"])
    assert ("ConfigMap", "mesh-dashboard") not in render() and ("PrometheusRule", "mesh") not in render()


def test_every_metric_the_dashboard_and_alerts_query_is_one_a_running_mesh_exports(tiny_checkpoint):
    wanted = {name: where for where, expr in queries().items() for name in METRIC.findall(expr)}
    folder, _ = tiny_checkpoint("qwen3_moe")
    proc, address = start_mesh(str(folder), "--experts", "1", "--kv-pool", "mooncake", "--kv-pool-memory", "64 MB",
                               "--local-prefill-max-tokens", "8")
    instances = started(address)
    try:
        g = torch.Generator().manual_seed(3)
        long, short = (torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (40, 5))
        for prompt in (long, short, long):  # disaggregated (a KV transfer), local, and a cached prefix
            assert generate(address, prompt)[0]
        status = json.loads(cli("status", "--target", address, "--json").stdout)
        exported = {name for i in status["instances"] if i["metrics_url"] for name, _ in scrape(i["metrics_url"])}
    finally:
        stop_mesh(proc, [i["pid"] for i in instances])
    assert {i["role"] for i in status["instances"]} == {"router", "prefill", "decode", "expert", "supervisor"}
    missing = {name: where for name, where in wanted.items() if name not in exported | KUBE_STATE_METRICS}
    assert missing == {}
