"""The operator's CLI, what it sends and what it says: `scale --kubernetes` patches the scale subresource of
the Helm release's workload through the official client (checked on the wire against a stand-in for the
API server: no cluster runs here) or prints the patch with --dry-run; bad arguments exit 2 with one line;
the CLI's whole surface (every command's help) is frozen by a snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import kubernetes
import pytest
import typer

from mesh.cli_admin import _patch_kubernetes, kubernetes_scale_patch
from tests.test_mesh_processes import cli

SNAPSHOT = Path(__file__).parent / "cli_help.txt"
COMMANDS = ("generate", "up", "demo", "rank", "status", "drain", "scale", "plan")


class ApiServer(BaseHTTPRequestHandler):
    """Answers PATCH .../scale and the list of a namespace's HorizontalPodAutoscalers (`hpas`) as the
    Kubernetes API does, and keeps what it was sent."""

    seen: list = []
    hpas: list = []

    def do_GET(self):
        assert self.path.startswith("/apis/autoscaling/v2/namespaces/") and \
            self.path.endswith("/horizontalpodautoscalers"), self.path
        self._answer({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscalerList", "metadata": {},
                      "items": ApiServer.hpas})

    def _answer(self, document: dict) -> None:
        answer = json.dumps(document).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_PATCH(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ApiServer.seen.append((self.path, self.headers["Content-Type"], body))
        self._answer({"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": "x"}, "spec": body["spec"]})

    def log_message(self, *args):
        pass


@pytest.fixture
def api_server():
    server = HTTPServer(("127.0.0.1", 0), ApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ApiServer.seen, ApiServer.hpas = [], []
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("multi_node, path", [
    (False, "/apis/apps/v1/namespaces/serving/deployments/prod-decode/scale"),
    (True, "/apis/leaderworkerset.x-k8s.io/v1/namespaces/serving/leaderworkersets/prod-decode/scale"),
])
def test_scale_kubernetes_patches_the_releases_workload_through_the_official_client(api_server, multi_node, path):
    patch = kubernetes_scale_patch("decode", 3, "serving", "prod", multi_node)
    assert patch.path == path and patch.body == {"spec": {"replicas": 3}}
    configuration = kubernetes.client.Configuration(host=api_server)
    _patch_kubernetes(patch, kubernetes.client.ApiClient(configuration))
    ((sent_path, content_type, body),) = ApiServer.seen
    assert (sent_path, body) == (path, {"spec": {"replicas": 3}}) and "patch" in content_type


def test_scale_kubernetes_refuses_a_workload_an_autoscaler_owns(api_server, capsys):
    ApiServer.hpas = [{"metadata": {"name": "keda-hpa-prod-decode"}, "spec": {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "prod-decode"},
        "maxReplicas": 8}}]
    client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=api_server))
    with pytest.raises(typer.Exit) as exited:
        _patch_kubernetes(kubernetes_scale_patch("decode", 3, "serving", "prod", False), client)
    assert exited.value.exit_code == 2 and ApiServer.seen == []  # nothing patched
    assert "deployments/prod-decode in serving is scaled by HorizontalPodAutoscaler keda-hpa-prod-decode" in \
        capsys.readouterr().err
    _patch_kubernetes(kubernetes_scale_patch("prefill", 3, "serving", "prod", False), client)  # not owned
    ((path, _, _),) = ApiServer.seen
    assert path == "/apis/apps/v1/namespaces/serving/deployments/prod-prefill/scale"


def test_scale_dry_run_prints_the_patch_and_bad_arguments_exit_2():
    out = cli("scale", "prefill", "4", "--kubernetes", "--namespace", "gpu", "--release", "mesh", "--dry-run")
    assert out.returncode == 0 and out.stdout.strip() == \
        'PATCH /apis/apps/v1/namespaces/gpu/deployments/mesh-prefill/scale {"spec": {"replicas": 4}}'
    for args, words in ((("scale", "router", "2"), "role must be one of prefill, decode, got 'router'"),
                        (("scale", "decode", "--", "-1"), "instances must be >= 0, got -1")):
        out = cli(*args)
        assert out.returncode == 2 and out.stderr.strip() == f"error: {words}"
    out = cli("drain")
    assert out.returncode == 2 and out.stderr.strip() == "error: give an INSTANCE_ID or --address (one of them)"
    out = cli("drain", "nobody", "--target", "127.0.0.1:1")  # nothing listens there
    assert out.returncode == 1 and out.stderr.startswith("error: 127.0.0.1:1: UNAVAILABLE")


def help_text() -> str:
    env = {**os.environ, "COLUMNS": "120", "TERM": "dumb", "NO_COLOR": "1"}
    infermesh = str(Path(sys.executable).parent / "infermesh")
    pages = []
    for command in ("", *COMMANDS):
        args = [infermesh, *([command] if command else []), "--help"]
        pages.append(f"$ infermesh {command} --help\n" + subprocess.run(args, capture_output=True, text=True,
                                                                          env=env, timeout=60).stdout)
    return "\n".join(pages)


def test_the_cli_surface_is_the_snapshot():
    """A changed command, option or help text is a conscious change: INFERMESH_UPDATE_SNAPSHOT=1 rewrites it."""
    text = help_text()
    if os.environ.get("INFERMESH_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), "the CLI changed: review, then INFERMESH_UPDATE_SNAPSHOT=1 pytest " + __file__
