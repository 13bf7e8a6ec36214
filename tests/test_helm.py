"""The Helm chart, as far as offline tools go: `helm lint` passes with the default values and with a multi-node
GPU cluster's (helm/infermesh/ci/gpu-cluster-values.yaml); every rendered built-in manifest, and the pod
templates inside each LeaderWorkerSet, pass `kubernetes-validate --strict`; what is rendered follows the
values: GPUs equal to the ranks a pod runs, a LeaderWorkerSet of ranks / gpusPerNode pods for an instance
that spans nodes, the router pointed at Redis, gRPC health probes, a drain before a pod stops, and with
`tls.secret` the Secret mounted in every pod and probes on the plaintext health port."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mesh.settings import (
    DecodeSettings,
    ExpertSettings,
    PrefillSettings,
    RouterSettings,
    load,
    parse_flags,
    to_flags,
)

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "infermesh"
GPU_VALUES = CHART / "ci" / "gpu-cluster-values.yaml"
HELM = Path(sys.executable).parent / "helm"  # installed by `make setup`


def helm(*args: str) -> subprocess.CompletedProcess:
    assert HELM.exists(), f"{HELM} is missing: `make setup` installs it"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)


def render(*args: str) -> dict[tuple[str, str], dict]:
    out = helm("template", "mesh", str(CHART), *args)
    assert out.returncode == 0, out.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout) if d}


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def gpus(container: dict) -> tuple[int, int]:
    resources = container["resources"]
    return resources.get("requests", {}).get("nvidia.com/gpu", 0), resources.get("limits", {}).get("nvidia.com/gpu", 0)


TLS = ["--set", "tls.secret=mesh-tls", "--set", "tls.serverName=infermesh.mesh"]


KV_POOL = ["--set", "kvPool.enabled=true"]
HPA = ["--set", "autoscaling.enabled=true", "--set", "autoscaling.kind=hpa"]
KEDA = ["--set", "autoscaling.enabled=true"]
OBSERVABILITY = ["--set", "metrics.grafanaDashboard.enabled=true", "--set", "metrics.prometheusRule.enabled=true"]


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)], ["-f", str(GPU_VALUES), *TLS], KV_POOL,
                                    ["-f", str(GPU_VALUES), *HPA], KEDA + OBSERVABILITY],
                         ids=["default", "gpu-cluster", "gpu-cluster-tls", "kv-pool", "gpu-cluster-hpa",
                              "keda-dashboards-alerts"])
def test_the_chart_lints_and_renders_valid_kubernetes(values, tmp_path):
    lint = helm("lint", str(CHART), *values)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    files = []
    for (kind, name), doc in render(*values).items():
        if kind == "LeaderWorkerSet":  # a CRD: no schema offline, but its pod templates are built-in kinds
            for part in ("leaderTemplate", "workerTemplate"):
                pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-{part.lower()}"},
                       "template": doc["spec"]["leaderWorkerTemplate"][part]}
                files.append(tmp_path / f"{name}-{part}.yaml")
                files[-1].write_text(yaml.safe_dump(pod))
        elif kind not in ("ServiceMonitor", "ScaledObject", "PrometheusRule"):  # CRDs too: asserted on elsewhere
            files.append(tmp_path / f"{kind}-{name}.yaml")
            files[-1].write_text(yaml.safe_dump(doc))
    validate = subprocess.run([str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "--quiet",
                               *map(str, files)], capture_output=True, text=True, timeout=300)
    assert validate.returncode == 0, validate.stdout + validate.stderr


def test_default_values_give_one_gpu_pod_per_instance_redis_and_grpc_probes():
    rendered = render()
    router, prefill, decode = (rendered["Deployment", f"mesh-{role}"] for role in ("router", "prefill", "decode"))
    assert ("Deployment", "mesh-expert") not in rendered and ("Deployment", "mesh-redis") in rendered
    assert "--registry=redis://mesh-redis:6379/0" in containers(router)[0]["args"]
    assert "--registry=redis://mesh-redis:6379/0" in containers(decode)[0]["args"]
    for workload in (prefill, decode):
        (container,) = containers(workload)
        assert gpus(container) == (1, 1)
        assert container["readinessProbe"]["grpc"] == {"port": 8000}
        assert container["livenessProbe"]["grpc"] == {"port": 8000, "service": "liveness"}
        drain = container["lifecycle"]["preStop"]["exec"]["command"][2]
        assert drain == "infermesh drain --address $POD_IP:8000 --wait"
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 120  # longer than a drain
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in \
            workload["spec"]["template"]["spec"]["volumes"]
    assert gpus(containers(router)[0]) == (0, 0) and "--http-port=8001" in containers(router)[0]["args"]
    assert all({"--quantization=none", "--batch-invariant=true"} <= set(containers(w)[0]["args"])
               for w in (prefill, decode))
    int8 = render("--set", "model.quantization=int8", "--set", "model.batchInvariant=false")
    assert all({"--quantization=int8", "--batch-invariant=false"} <= set(
        containers(int8["Deployment", f"mesh-{role}"])[0]["args"]) for role in ("prefill", "decode"))
    assert not [e for c in containers(decode) for e in c["env"] if e["name"] == "INFERMESH_ADMIN_TOKEN"]
    service = rendered["Service", "mesh-router"]
    assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "http"}
    assert rendered["PodDisruptionBudget", "mesh-decode"]["spec"]["selector"]["matchLabels"][
        "app.kubernetes.io/component"] == "decode"


def test_a_multi_node_gpu_cluster_renders_leader_worker_sets_that_follow_the_ranks():
    rendered = render("-f", str(GPU_VALUES))
    lws = rendered["LeaderWorkerSet", "mesh-prefill"]["spec"]
    template = lws["leaderWorkerTemplate"]
    assert lws["replicas"] == 2 and template["size"] == 2  # CP=16 over two 8-GPU nodes
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader,) = template["leaderTemplate"]["spec"]["containers"]
    (worker,) = template["workerTemplate"]["spec"]["containers"]
    assert gpus(leader) == gpus(worker) == (8, 8)
    assert {"--cp=16", "--local-ranks=8", "--rendezvous-port=29500", "--experts=mesh-expert:8000"} <= set(
        leader["args"])
    assert "startupProbe" in leader and "readinessProbe" in leader and "livenessProbe" in leader
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)  # probes on the leader only
    join = worker["command"][2]
    assert 'infermesh rank --join "$LWS_LEADER_ADDRESS:29500"' in join
    assert '--rank "$((LWS_WORKER_INDEX * 8))" --count 8 --host "$POD_IP"' in join
    decode = rendered["Deployment", "mesh-decode"]
    assert decode["spec"]["replicas"] == 4 and gpus(containers(decode)[0]) == (8, 8)
    assert {"--tp=8", "--local-ranks=8", "--device=cuda"} <= set(containers(decode)[0]["args"])
    expert = rendered["Deployment", "mesh-expert"]
    assert gpus(containers(expert)[0]) == (8, 8) and "--ep=8" in containers(expert)[0]["args"]
    assert ("Deployment", "mesh-redis") not in rendered
    router_args = containers(rendered["Deployment", "mesh-router"])[0]["args"]
    assert "--registry=redis://redis.infra.svc:6379/0" in router_args and "--trace=otlp" in router_args
    admin_token = {"name": "INFERMESH_ADMIN_TOKEN",
                   "valueFrom": {"secretKeyRef": {"name": "infermesh-admin", "key": "token"}}}
    for container in (leader, worker, *(containers(rendered["Deployment", f"mesh-{role}"])[0]
                                        for role in ("router", "decode", "expert"))):
        assert admin_token in container["env"]  # the preStop drain and the instance's check both read it
    monitor = rendered["ServiceMonitor", "mesh"]
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_tls_mounts_the_secret_everywhere_and_probes_a_plaintext_health_port():
    rendered = render("-f", str(GPU_VALUES), *TLS)
    template = rendered["LeaderWorkerSet", "mesh-prefill"]["spec"]["leaderWorkerTemplate"]
    pods = [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"],
            *(rendered["Deployment", f"mesh-{role}"]["spec"]["template"]["spec"] for role in ("router", "decode",
                                                                                              "expert"))]
    for pod in pods:
        assert {"name": "tls", "secret": {"secretName": "mesh-tls"}} in pod["volumes"]
        (container,) = pod["containers"]
        assert {"name": "tls", "mountPath": "/etc/infermesh/tls", "readOnly": True} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["INFERMESH_TLS_CA"] == "/etc/infermesh/tls/ca.crt"
        assert env["INFERMESH_TLS_CERT"] == "/etc/infermesh/tls/tls.crt"
        assert env["INFERMESH_TLS_KEY"] == "/etc/infermesh/tls/tls.key"
        assert env["INFERMESH_TLS_SERVER_NAME"] == "infermesh.mesh"
    for pod in (pods[0], *pods[2:]):  # every service's process: probes on the health port it serves
        (container,) = pod["containers"]
        assert "--health-port=8002" in container["args"]
        assert {"name": "health", "containerPort": 8002} in container["ports"]
        assert container["readinessProbe"]["grpc"] == container["startupProbe"]["grpc"] == {"port": 8002}
        assert container["livenessProbe"]["grpc"] == {"port": 8002, "service": "liveness"}
    missing_name = helm("template", "mesh", str(CHART), "--set", "tls.secret=mesh-tls")
    assert missing_name.returncode != 0 and "tls.serverName" in missing_name.stderr


def test_values_that_cannot_work_are_refused_with_a_reason():
    uneven = helm("template", "mesh", str(CHART), "--set", "prefill.cp=12")
    assert uneven.returncode != 0 and "prefill.cp=12 is not a multiple of gpusPerNode=8" in uneven.stderr
    no_redis = helm("template", "mesh", str(CHART), "--set", "registry.redis.enabled=false")
    assert no_redis.returncode != 0 and "registry.externalUrl" in no_redis.stderr
    bad = helm("template", "mesh", str(CHART), "--set", "model.source.type=ftp")
    assert bad.returncode != 0 and "model/source/type" in bad.stderr  # values.schema.json
    int4 = helm("template", "mesh", str(CHART), "--set", "model.quantization=int4")
    assert int4.returncode != 0 and "model/quantization" in int4.stderr


SETTINGS = {"router.server": RouterSettings, "prefill_svc.server": PrefillSettings,
            "decode_svc.server": DecodeSettings, "expert_svc.server": ExpertSettings}


def service_containers(rendered: dict) -> list[tuple[str, dict]]:
    """(workload name, container) for every container that runs a service (`python -m <service>.server`)."""
    found = []
    for (kind, name), doc in rendered.items():
        if kind == "LeaderWorkerSet":
            pods = [doc["spec"]["leaderWorkerTemplate"][part] for part in ("leaderTemplate", "workerTemplate")]
        elif kind in ("Deployment", "StatefulSet"):
            pods = [doc["spec"]["template"]]
        else:
            continue
        found += [(name, c) for pod in pods for c in pod["spec"]["containers"]
                  if c.get("command", [])[:2] == ["python", "-m"]]
    return found


@pytest.mark.parametrize("values", [[], ["-f", str(GPU_VALUES)], ["-f", str(GPU_VALUES), *TLS],
                                    ["--set", "model.quantization=int8", "--set", "model.batchInvariant=false"],
                                    KV_POOL + ["--set", "mooncake.protocol=rdma", "--set", "mooncake.devices=mlx5_0"]],
                         ids=["default", "gpu-cluster", "gpu-cluster-tls", "int8", "kv-pool-rdma"])
def test_every_flag_the_chart_passes_is_a_setting_its_service_declares_and_accepts(values):
    """The chart's container args are read by the service's own settings declaration (mesh.settings): an
    undeclared flag, or a value its check refuses, fails here rather than in a pod."""
    rendered = service_containers(render(*values))
    assert {c["command"][2] for _, c in rendered} >= {"router.server", "prefill_svc.server", "decode_svc.server"}
    for name, container in rendered:
        cls = SETTINGS[container["command"][2]]
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        try:
            flags = parse_flags(cls, container["args"])
        except SystemExit:
            pytest.fail(f"{name}: {container['args']} holds a flag {cls.__name__} does not declare")
        settings = load(cls, flags, env)
        assert to_flags(settings, env), f"{name}: nothing differs from the defaults"  # the chart sets its own


def test_the_kv_pool_runs_from_our_image_and_one_rank_engines_point_at_it():
    docs = render(*KV_POOL, "--set", "prefill.cp=2")
    pool = docs[("Deployment", "mesh-kv-pool")]
    assert [c["command"] for c in containers(pool)] == [["mooncake_master"], ["mooncake_client"]]
    assert {c["image"] for c in containers(pool)} == {"ghcr.io/infermesh/infermesh:0.1.0"}
    assert "16 GB" in containers(pool)[1]["args"]
    assert docs[("Service", "mesh-kv-pool")]["spec"]["ports"][0]["port"] == 50051
    args = {name: c["args"] for name, c in service_containers(docs)}
    assert "--kv-pool=mooncake://mesh-kv-pool:50051" in args["mesh-decode"]
    assert not any(a.startswith("--kv-pool") for a in args["mesh-prefill"])  # two ranks: not yet
    assert ("Deployment", "mesh-kv-pool") not in render()  # off by default


def test_autoscaling_scales_prefill_and_decode_to_the_planners_metric_and_owns_their_replicas():
    """KEDA: a ScaledObject per role whose Prometheus trigger reads the planner's metric for that role in the
    release's namespace, one pod per desired instance; an HPA alike on the external metric, for a
    LeaderWorkerSet where an instance spans nodes. The workloads leave `replicas` to them."""
    keda = render(*KEDA, "--set", "autoscaling.prefill.minReplicas=0", "--namespace", "serving")
    for role in ("prefill", "decode"):
        scaled = keda["ScaledObject", f"mesh-{role}"]
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                    "name": f"mesh-{role}"}
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["query"] == \
            f'max(infermesh_planner_desired_instances{{role="{role}",namespace="serving"}})'
        assert trigger["metadata"]["threshold"] == "1"
        assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == \
            ((0 if role == "prefill" else 1), 8)
        assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"] == \
            {"stabilizationWindowSeconds": 300}
        assert "replicas" not in keda["Deployment", f"mesh-{role}"]["spec"]
    assert keda["Deployment", "mesh-router"]["spec"]["replicas"] == 2  # not autoscaled
    assert "replicas" in render()["Deployment", "mesh-decode"]["spec"]  # off by default

    hpa = render("-f", str(GPU_VALUES), *HPA, "--set", "autoscaling.prefill.minReplicas=0")
    for role, kind in (("prefill", "LeaderWorkerSet"), ("decode", "Deployment")):  # CP=16 over two nodes, TP=8
        spec = hpa["HorizontalPodAutoscaler", f"mesh-{role}"]["spec"]
        assert spec["scaleTargetRef"]["kind"] == kind and "replicas" not in hpa[kind, f"mesh-{role}"]["spec"]
        (metric,) = spec["metrics"]
        assert metric["external"]["metric"] == {"name": "infermesh_planner_desired_instances",
                                                "selector": {"matchLabels": {"role": role}}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert spec["minReplicas"] == 1  # an HPA cannot scale to zero without a feature gate
    router = containers(hpa["Deployment", "mesh-router"])[0]["args"]
    assert {"--ttft-slo-s=1", "--tpot-slo-s=0.1", "--planner-interval-s=30"} <= set(router)
