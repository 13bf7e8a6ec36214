"""The operator's commands of the `infermesh` CLI: look at a running mesh and change it.

    infermesh status --target ROUTER [--json]
    infermesh drain INSTANCE_ID --target ROUTER [--timeout-s S] [--wait]
    infermesh drain --address HOST:PORT [--wait]      # the instance at that address (a preStop hook)
    infermesh scale ROLE N --target ROUTER
    infermesh scale ROLE N --kubernetes [--namespace NS] [--release NAME] [--dry-run]
    infermesh plan --target ROUTER [--ttft-slo-ms N] [--tpot-slo-ms N] [--apply]

Every command reaches the mesh through its router (`Admin.ListInstances` gives every instance and its
address). `scale` on a local mesh asks the `infermesh up` supervisor (registered with role
`supervisor`), which starts instances or drains the newest; with `--kubernetes` it patches the scale of
the role's workload of the Helm release instead (`kubernetes_scale_patch`). `plan` reads the router's
metrics in windows and prints what `mesh.planner` recommends (and scales to it with --apply). When the
mesh has an admin token, drain, scale and plan --apply send it (`--admin-token` or INFERMESH_ADMIN_TOKEN);
without it they are refused (UNAUTHENTICATED). Failures exit 1 with one line naming the target and the
status; bad arguments exit 2.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import grpc
import typer
from rich.console import Console
from rich.table import Table

from mesh import planner, rpc
from mesh.auth import ADMIN_TOKEN_ENV, credentials
from mesh.metrics import scrape
from mesh.planner import PlannerConfig
from mesh.registry import InstanceInfo, InstanceState, Role
from mesh.registry.remote import ROLES, from_message
from protos.infermesh.v1 import common_pb2, internal_pb2, internal_pb2_grpc

SCALABLE_ROLES = ("prefill", "decode")
PLANNER = PlannerConfig()  # the SLOs `plan` sizes against unless told


def _admin_token() -> str:
    return typer.Option("", envvar=ADMIN_TOKEN_ENV, show_default=False,
                        help=f"The mesh's admin bearer token, when it has one (prefer {ADMIN_TOKEN_ENV}).")


def _exit(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=code)


def _instances(target: str) -> list[InstanceInfo]:
    try:
        with rpc.channel(target) as ch:
            found = internal_pb2_grpc.AdminStub(ch).ListInstances(internal_pb2.ListInstancesRequest(), timeout=10)
    except grpc.RpcError as e:
        _exit(f"{target}: {e.code().name}: {e.details()}")
    return [from_message(m) for m in found.instances]


def status(
    target: str = typer.Option("127.0.0.1:8000", help="HOST:PORT of the mesh's router."),
    as_json: bool = typer.Option(False, "--json", help="Print the instances as JSON (with metrics_url)."),
) -> None:
    """The instances of a running mesh: per-role totals, then each instance's state, load, KV use and metrics;
    for a mesh `infermesh up` runs, each of its processes too: state, restarts, last exit and why."""
    instances = _instances(target)
    processes = _processes(instances)
    if as_json:
        keys = ("id", "address", "pid", "model", "parallel", "active_requests", "total_requests", "kv_blocks_used",
                "kv_blocks_total", "http_address", "metrics_url")
        rows = [{"role": i.role.value, "state": i.state.value, **{k: getattr(i, k) for k in keys}} for i in instances]
        sys.stdout.write(json.dumps({"instances": rows, "processes": processes}) + "\n")
        return
    totals = Table(title="roles", title_justify="left")
    for column in ("role", "instances", "serving", "active", "KV blocks"):
        totals.add_column(column, justify="left" if column == "role" else "right")
    for role in Role:
        mine = [i for i in instances if i.role is role]
        if mine:
            used, total = sum(i.kv_blocks_used for i in mine), sum(i.kv_blocks_total for i in mine)
            totals.add_row(role.value, str(len(mine)), str(sum(i.state is InstanceState.SERVING for i in mine)),
                           str(sum(i.active_requests for i in mine)), f"{used}/{total}" if total else "-")
    table = Table(title="instances", title_justify="left")
    for column in ("role", "id", "address", "pid", "tp/cp/ep", "state", "active", "total", "KV blocks", "metrics",
                   "http"):
        table.add_column(column, no_wrap=True)
    for i in instances:
        layout = "/".join(str(i.parallel.get(k, 1)) for k in ("tp", "cp", "ep"))
        table.add_row(i.role.value, i.id, i.address, str(i.pid), layout, i.state.value, str(i.active_requests),
                      str(i.total_requests), f"{i.kv_blocks_used}/{i.kv_blocks_total}" if i.kv_blocks_total else "-",
                      i.metrics_url or "-", i.http_address or "-")
    console = Console(width=200)
    console.print(totals)
    console.print(table)
    if processes:
        kept = Table(title="processes (infermesh up)", title_justify="left")
        for column in ("name", "pid", "state", "restarts", "last exit", "reason"):
            kept.add_column(column, no_wrap=column != "reason")
        for p in processes:
            kept.add_row(p["name"], str(p["pid"]), p["state"], str(p["restarts"]),
                         "-" if p["last_exit"] is None else str(p["last_exit"]), p["reason"] or "-")
        console.print(kept)


def _processes(instances: list[InstanceInfo]) -> list[dict]:
    """The processes of the `infermesh up` supervisor among `instances` (none: a mesh it does not run). One that
    cannot be asked (with TLS, a client without the mesh's certificate reaches the router alone) is named on
    stderr and left out: the instances are still worth showing."""
    rows = []
    for supervisor in (i for i in instances if i.role is Role.SUPERVISOR):
        try:
            with rpc.channel(supervisor.address) as ch:
                found = internal_pb2_grpc.SupervisorStub(ch).Processes(internal_pb2.ProcessesRequest(), timeout=10)
        except grpc.RpcError as e:
            typer.echo(f"note: no processes from {supervisor.id} at {supervisor.address}: {e.code().name}: "
                       f"{e.details()}", err=True)
            continue
        rows += [{"name": p.name, "kind": p.kind, "pid": p.pid, "restarts": p.restarts, "reason": p.reason,
                  "state": internal_pb2.ProcessState.Name(p.state).removeprefix("PROCESS_STATE_").lower(),
                  "last_exit": p.last_exit if p.HasField("last_exit") else None} for p in found.processes]
    return rows


def drain(
    instance_id: Optional[str] = typer.Argument(None, help="The instance to drain (an id from `infermesh status`)."),
    target: str = typer.Option("127.0.0.1:8000", help="HOST:PORT of the mesh's router, to find INSTANCE_ID."),
    address: Optional[str] = typer.Option(None, help="HOST:PORT of the instance itself, instead of an id (preStop)."),
    timeout_s: float = typer.Option(0.0, help="Stop it after this long even if work is left (0: its own setting)."),
    wait: bool = typer.Option(False, "--wait", help="Return once it has left the mesh."),
    admin_token: str = _admin_token(),
) -> None:
    """Drain one instance: it takes no new work, finishes what it holds, deregisters and exits."""
    if (instance_id is None) == (address is None):
        _exit("give an INSTANCE_ID or --address (one of them)", code=2)
    if address is None:
        found = [i for i in _instances(target) if i.id == instance_id]
        if not found:
            _exit(f"no instance {instance_id!r} in the mesh at {target}", code=2)
        address = found[0].address
    try:
        with rpc.channel(address) as ch:
            status = internal_pb2_grpc.AdminStub(ch).Drain(internal_pb2.DrainRequest(timeout_s=timeout_s), timeout=10,
                                                           metadata=credentials(admin_token))
    except grpc.RpcError as e:
        _exit(f"{instance_id or address}: {e.code().name}: {e.details()}")
    typer.echo(f"{status.id} {common_pb2.InstanceState.Name(status.state).removeprefix('INSTANCE_STATE_')}")
    if wait:
        while _answers(address):
            time.sleep(0.2)
        typer.echo(f"{status.id} left")


def _answers(address: str) -> bool:
    """Whether an instance still serves Admin at `address` (a drained one stops once its work is done)."""
    try:
        with rpc.channel(address) as ch:
            internal_pb2_grpc.AdminStub(ch).Status(internal_pb2.StatusRequest(), timeout=2)
        return True
    except grpc.RpcError:
        return False


@dataclass(frozen=True, slots=True)
class ScalePatch:
    """What `scale --kubernetes` changes: the scale subresource of one workload of the Helm release."""

    group: str  # "apps" for a Deployment, "leaderworkerset.x-k8s.io" for a multi-node instance
    version: str
    plural: str
    namespace: str
    name: str
    replicas: int

    @property
    def path(self) -> str:
        return f"/apis/{self.group}/{self.version}/namespaces/{self.namespace}/{self.plural}/{self.name}/scale"

    @property
    def body(self) -> dict:
        return {"spec": {"replicas": self.replicas}}


def kubernetes_scale_patch(role: str, replicas: int, namespace: str, release: str, multi_node: bool) -> ScalePatch:
    """The patch for `role` of the chart's release: workloads are named `<release>-<role>`; an instance whose
    ranks span nodes is a LeaderWorkerSet, whose replicas are instances (groups), like a Deployment's."""
    if multi_node:
        return ScalePatch("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", namespace, f"{release}-{role}",
                          replicas)
    return ScalePatch("apps", "v1", "deployments", namespace, f"{release}-{role}", replicas)


def scale(
    role: str = typer.Argument(..., help="prefill | decode"),
    instances: int = typer.Argument(..., help="How many instances the role should have."),
    target: str = typer.Option("127.0.0.1:8000", help="HOST:PORT of the mesh's router (a local mesh)."),
    kubernetes: bool = typer.Option(False, "--kubernetes", help="Scale the Helm release's workload instead."),
    namespace: str = typer.Option("default", help="With --kubernetes: the release's namespace."),
    release: str = typer.Option("infermesh", help="With --kubernetes: the Helm release name."),
    multi_node: bool = typer.Option(False, "--multi-node",
                                    help="With --kubernetes: the role's instances are LeaderWorkerSets."),
    dry_run: bool = typer.Option(False, "--dry-run", help="With --kubernetes: print the patch, change nothing."),
    admin_token: str = _admin_token(),
) -> None:
    """Scale a role to N instances: new ones register and get traffic, removed ones drain first."""
    if role not in SCALABLE_ROLES:
        _exit(f"role must be one of {', '.join(SCALABLE_ROLES)}, got {role!r}", code=2)
    if instances < 0:
        _exit(f"instances must be >= 0, got {instances}", code=2)
    if kubernetes:
        patch = kubernetes_scale_patch(role, instances, namespace, release, multi_node)
        if dry_run:
            typer.echo(f"PATCH {patch.path} {json.dumps(patch.body)}")
            return
        _patch_kubernetes(patch)
        typer.echo(f"{patch.plural}/{patch.name} in {namespace}: replicas {instances}")
        return
    _scale_locally(target, role, instances, admin_token)


def _scale_locally(target: str, role: str, instances: int, admin_token: str) -> None:
    supervisors = [i for i in _instances(target) if i.role is Role.SUPERVISOR]
    if not supervisors:
        _exit(f"the mesh at {target} has no `infermesh up` supervisor to start or stop processes; "
              "on Kubernetes use --kubernetes", code=2)
    try:
        with rpc.channel(supervisors[0].address) as ch:
            done = internal_pb2_grpc.SupervisorStub(ch).Scale(
                internal_pb2.ScaleRequest(role=ROLES[Role(role)], instances=instances), timeout=900,
                metadata=credentials(admin_token))
    except grpc.RpcError as e:
        _exit(f"scale {role}: {e.code().name}: {e.details()}")
    for instance_id in done.started:
        typer.echo(f"{instance_id} started")
    for instance_id in done.drained:
        typer.echo(f"{instance_id} drained")
    typer.echo(f"{role}: {done.instances} instances")


def plan(
    target: str = typer.Option("127.0.0.1:8000", help="HOST:PORT of the mesh's router."),
    ttft_slo_ms: float = typer.Option(PLANNER.ttft_slo_s * 1000, help="Time to first token, p90 (sizes prefill)."),
    tpot_slo_ms: float = typer.Option(PLANNER.tpot_slo_s * 1000, help="Time per output token, p90 (sizes decode)."),
    interval_s: float = typer.Option(10.0, help="Seconds per window of the router's metrics."),
    windows: int = typer.Option(3, help="Windows to watch (a step down waits for 3 quiet ones)."),
    apply: bool = typer.Option(False, "--apply", help="Scale to the plan after each window (the local mesh, or"
                                                         " with --kubernetes the Helm release)."),
    kubernetes: bool = typer.Option(False, "--kubernetes", help="With --apply: scale the Helm release's workloads."),
    namespace: str = typer.Option("default", help="With --kubernetes: the release's namespace."),
    release: str = typer.Option("infermesh", help="With --kubernetes: the Helm release name."),
    multi_node: str = typer.Option("", "--multi-node",
                                   help="With --kubernetes: roles that are LeaderWorkerSets, e.g. prefill,decode."),
    admin_token: str = _admin_token(),
) -> None:
    """Recommend prefill and decode instance counts from the live metrics against the SLOs (--apply: scale)."""
    config = PlannerConfig(ttft_slo_s=ttft_slo_ms / 1000, tpot_slo_s=tpot_slo_ms / 1000)
    routers = [i for i in _instances(target) if i.role is Role.ROUTER and i.metrics_url]
    if not routers:
        _exit(f"the mesh at {target} has no router that serves metrics", code=2)
    history: list = []
    before = _scrape(routers[0].metrics_url)
    for _ in range(windows):
        time.sleep(interval_s)
        after = _scrape(routers[0].metrics_url)
        history.append(planner.window(before, after, interval_s))
        before = after
        counts = {role: sum(i.role is role and i.state is InstanceState.SERVING for i in _instances(target))
                  for role in (Role.PREFILL, Role.DECODE)}
        decided = planner.plan(history, counts[Role.PREFILL], counts[Role.DECODE], config)
        typer.echo(f"prefill {counts[Role.PREFILL]} -> {decided.prefill}, decode {counts[Role.DECODE]} -> "
                   f"{decided.decode}: {decided.reason}")
        if apply:
            for role, n in (("decode", decided.decode), ("prefill", decided.prefill)):
                if n == counts[Role(role)]:
                    continue
                if kubernetes:
                    lws = role in multi_node.split(",")
                    _patch_kubernetes(kubernetes_scale_patch(role, n, namespace, release, lws))
                    typer.echo(f"{release}-{role} in {namespace}: replicas {n}")
                else:
                    _scale_locally(target, role, n, admin_token)


def _autoscaler(api, patch: ScalePatch) -> str:
    """The name of the HorizontalPodAutoscaler that scales the patch's workload (KEDA's ScaledObjects work through
    one, `keda-hpa-<name>`), or ""."""
    kind = "Deployment" if patch.group == "apps" else "LeaderWorkerSet"
    for hpa in api.list_namespaced_horizontal_pod_autoscaler(patch.namespace).items:
        target = hpa.spec.scale_target_ref
        if (target.kind, target.name) == (kind, patch.name):
            return hpa.metadata.name
    return ""


def _scrape(url: str) -> dict:
    try:
        return scrape(url)
    except OSError as e:
        _exit(f"{url}: {e}")


def _patch_kubernetes(patch: ScalePatch, api_client: Optional[object] = None) -> None:
    """Through the official client (the local kubeconfig, else the in-cluster service account)."""
    try:
        import kubernetes
    except ImportError:
        _exit("--kubernetes needs the official client: pip install 'infermesh[kubernetes]'", code=2)
    if api_client is None:
        try:
            kubernetes.config.load_kube_config()
        except Exception:  # noqa: BLE001 - no kubeconfig: try the pod's service account
            kubernetes.config.load_incluster_config()
    client = kubernetes.client
    try:
        owner = _autoscaler(client.AutoscalingV2Api(api_client), patch)
        if owner:
            _exit(f"{patch.plural}/{patch.name} in {patch.namespace} is scaled by HorizontalPodAutoscaler {owner}: "
                  "change its bounds (the chart's `autoscaling` values) or turn it off rather than fight it", code=2)
        if patch.group == "apps":
            client.AppsV1Api(api_client).patch_namespaced_deployment_scale(patch.name, patch.namespace, patch.body)
        else:
            client.CustomObjectsApi(api_client).patch_namespaced_custom_object_scale(
                patch.group, patch.version, patch.namespace, patch.plural, patch.name, patch.body)
    except client.ApiException as e:
        _exit(f"{patch.path}: {e.status} {e.reason}")
