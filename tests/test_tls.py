"""TLS on every gRPC hop of a real mesh (`infermesh up`, real processes), with a throwaway CA made here by
the `cryptography` package: the mesh serves end to end (router, prefill, KV pushed over gRPC, decode)
with tokens equal to the engine's; a client with only the CA may use the router's public API, gRPC and
HTTPS; to every other service a client without a certificate, with one from another CA, or in plaintext
is refused — it can neither read, reserve KV nor register — while the mesh's certificate works. A
`--health-port` answers plaintext health checks (the kubelet's probes) and nothing else."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from mesh import tls
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc, internal_pb2, internal_pb2_grpc
from tests.helpers import free_port
from tests.test_mesh_processes import cli, start_mesh, stop_mesh

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

ONE_DAY = datetime.timedelta(days=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(folder: Path, stem: str, key, cert: x509.Certificate) -> tuple[Path, Path]:
    key_path, cert_path = folder / f"{stem}.key", folder / f"{stem}.crt"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def certificate_authority(folder: Path, name: str):
    """(key, certificate, certificate path) of a new self-signed CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - ONE_DAY).not_valid_after(now + ONE_DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, _ = _pem(folder, name, key, cert)
    return key, cert, cert_path


def issue(folder: Path, ca, name: str) -> tuple[Path, Path]:
    """(certificate path, key path) for 127.0.0.1 and localhost, for servers and clients, signed by `ca`."""
    ca_key, ca_cert, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - ONE_DAY).not_valid_after(now + ONE_DAY)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pem(folder, name, key, cert)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pki")
    mesh_ca, rogue_ca = certificate_authority(folder, "mesh-ca"), certificate_authority(folder, "rogue-ca")
    mesh_cert, mesh_key = issue(folder, mesh_ca, "mesh")
    rogue_cert, rogue_key = issue(folder, rogue_ca, "rogue")
    return {"ca": mesh_ca[2], "cert": mesh_cert, "key": mesh_key, "rogue_cert": rogue_cert, "rogue_key": rogue_key}


def secure(address: str, ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes(),
                                               private_key=key.read_bytes() if key else None,
                                               certificate_chain=cert.read_bytes() if cert else None)
    return grpc.secure_channel(address, credentials)


def refused(method, request) -> bool:
    """The call fails at the handshake (gRPC reports UNAVAILABLE), before any handler runs."""
    try:
        method(request, timeout=10)
    except grpc.RpcError as e:
        return e.code() is grpc.StatusCode.UNAVAILABLE
    return False


def test_a_mesh_with_tls_serves_its_own_and_refuses_everyone_else(tiny_checkpoint, pki):
    folder, _ = tiny_checkpoint("llama")
    mesh_env = {tls.CA: str(pki["ca"]), tls.CERT: str(pki["cert"]), tls.KEY: str(pki["key"])}
    proc, address = start_mesh(str(folder), "--local-prefill-max-tokens", "0", "--http-port", "0",
                               env=mesh_env)  # every prompt through prefill
    status = cli("status", "--target", address, "--json", env={tls.CA: str(pki["ca"])})  # the CA alone: the router
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["processes"] == [] and "note: no processes from supervisor-" in status.stderr
    kept = json.loads(cli("status", "--target", address, "--json", env=mesh_env).stdout)["processes"]
    assert sorted(p["name"] for p in kept) == ["decode-0", "prefill-0", "registry", "router"]  # with the mesh's own
    instances = json.loads(status.stdout)["instances"]
    by_role = {i["role"]: i for i in instances}
    try:
        answer = cli("generate", "the quick brown fox", "--target", address, "--json", "--max-tokens", "8",
                     "--ignore-eos", env={tls.CA: str(pki["ca"])})
        assert answer.returncode == 0, answer.stderr
        result = json.loads(answer.stdout.splitlines()[-1])
        reference = LLM(str(folder), dtype="float32").generate(
            [result["prompt_token_ids"]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert result["token_ids"] == reference[0].token_ids
        decode_status = internal_pb2_grpc.AdminStub(secure(by_role["decode"]["address"], pki["ca"], pki["cert"],
                                                           pki["key"])).Status(internal_pb2.StatusRequest(), timeout=10)
        assert decode_status.total_requests == 1 and decode_status.kv_blocks_used == 0  # the request went there
        completion = httpx.post(f"https://{by_role['router']['http_address']}/v1/completions", verify=str(pki["ca"]),
                                json={"prompt": result["prompt_token_ids"], "max_tokens": 8, "temperature": 0,
                                      "ignore_eos": True}, timeout=60)
        assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == result["text"]

        plaintext = grpc.insecure_channel(address)
        assert refused(inference_pb2_grpc.InferenceStub(plaintext).ListModels, inference_pb2.ListModelsRequest())
        for role in ("decode", "prefill", "supervisor"):
            target = by_role[role]["address"]
            for channel in (grpc.insecure_channel(target), secure(target, pki["ca"]),
                            secure(target, pki["ca"], pki["rogue_cert"], pki["rogue_key"])):
                assert refused(internal_pb2_grpc.AdminStub(channel).Status, internal_pb2.StatusRequest()), role
        rogue = secure(by_role["decode"]["address"], pki["ca"], pki["rogue_cert"], pki["rogue_key"])
        assert refused(internal_pb2_grpc.DecodeStub(rogue).Reserve, internal_pb2.ReserveRequest(
            request_id="r", prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(max_tokens=1)))
        rogue = secure(by_role["supervisor"]["address"], pki["ca"], pki["rogue_cert"], pki["rogue_key"])
        assert refused(internal_pb2_grpc.RegistryStub(rogue).Register, internal_pb2.RegisterRequest(
            instance=internal_pb2.InstanceStatus(id="decode-rogue", address="127.0.0.1:1"), ttl_s=60))
        after = cli("status", "--target", address, "--json", env={tls.CA: str(pki["ca"])})
        assert [i["id"] for i in json.loads(after.stdout)["instances"]] == [i["id"] for i in instances]
    finally:
        stop_mesh(proc, [i["pid"] for i in instances if i["role"] != "supervisor"])


def test_the_health_port_answers_probes_in_plaintext_and_serves_nothing_else(tiny_checkpoint, pki):
    folder, _ = tiny_checkpoint("llama")
    health_port = free_port()
    env = {**os.environ, tls.CA: str(pki["ca"]), tls.CERT: str(pki["cert"]), tls.KEY: str(pki["key"])}
    router = subprocess.Popen([sys.executable, "-m", "router.server", "--model", str(folder), "--http-port", "0",
                               "--health-port", str(health_port)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        ready = router.stdout.readline()  # "router ID serving on ADDRESS (http HOST:PORT)"
        address, http = ready.split()[4], ready.split()[-1].rstrip(")")
        probe = grpc.insecure_channel(f"127.0.0.1:{health_port}")
        for service in ("", "liveness"):  # what the kubelet's readiness and liveness probes ask
            answer = health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as nothing_else:
            internal_pb2_grpc.AdminStub(probe).Status(internal_pb2.StatusRequest(), timeout=10)
        assert nothing_else.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert refused(internal_pb2_grpc.AdminStub(grpc.insecure_channel(address)).Status,
                       internal_pb2.StatusRequest())  # the service port itself still takes TLS only
        assert httpx.get(f"https://{http}/health", verify=str(pki["ca"]), timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):  # no plaintext HTTP either
            httpx.get(f"http://{http}/health", timeout=10)
    finally:
        router.terminate()
        assert router.wait(timeout=30) == 0


def test_tls_settings_that_cannot_work_are_named(tmp_path):
    assert tls.identity({}) is None
    with pytest.raises(ValueError, match=f"{tls.KEY} not set"):
        tls.identity({tls.CA: "ca.pem", tls.CERT: "cert.pem"})
    with pytest.raises(ValueError, match=f"{tls.CA} not set"):
        tls.identity({tls.CERT: "cert.pem", tls.KEY: "key.pem"})
    missing = tmp_path / "nowhere.pem"
    with pytest.raises(ValueError, match=f"{tls.CA}={missing}: No such file"):
        tls.identity({tls.CA: str(missing)})
