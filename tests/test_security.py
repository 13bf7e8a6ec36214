"""Tokens on a real mesh (`infermesh up`, real processes): with an admin token set, `drain` and `scale`
without it or with a wrong one are refused with UNAUTHENTICATED and change nothing, reading (`status`)
stays open, the right token works; the token reaches the instances through their environment, never a
command line or a log. Every process of a mesh listens on the interface it was given, none on all."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh.auth import ADMIN_TOKEN_ENV
from tests.helpers import descendants, listening
from tests.test_mesh_processes import cli, start_mesh, started, stop_mesh

pytestmark = pytest.mark.slow  # whole meshes of processes, real weights or benchmarks: minutes in all

TOKEN = "s3cret-admin-token-42"


def refused(proc) -> bool:
    return proc.returncode == 1 and "UNAUTHENTICATED" in proc.stderr and TOKEN not in proc.stderr


def test_admin_operations_need_the_admin_token(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama")
    proc, address = start_mesh(str(folder), "--log-dir", str(tmp_path), env={ADMIN_TOKEN_ENV: TOKEN})
    instances = started(address)  # reading needs no token
    pids = [i["pid"] for i in instances]
    decode = next(i for i in instances if i["role"] == "decode")
    try:
        for env in ({}, {ADMIN_TOKEN_ENV: "wrong"}):
            assert refused(cli("drain", decode["id"], "--target", address, env=env))
            assert refused(cli("drain", "--address", decode["address"], env=env))
            assert refused(cli("scale", "decode", "2", "--target", address, env=env))
        assert refused(cli("drain", decode["id"], "--target", address, "--admin-token", "wrong"))
        assert [(i["id"], i["state"]) for i in started(address)] == [(i["id"], "serving") for i in instances]

        scaled = cli("scale", "decode", "2", "--target", address, "--admin-token", TOKEN)
        assert scaled.returncode == 0, scaled.stderr
        decodes = [i for i in started(address) if i["role"] == "decode"]
        assert len(decodes) == 2
        pids += [i["pid"] for i in decodes]
        drained = cli("drain", decode["id"], "--target", address, "--wait", env={ADMIN_TOKEN_ENV: TOKEN})
        assert drained.returncode == 0 and drained.stdout.splitlines()[-1] == f"{decode['id']} left", drained.stderr
        for pid in {i["pid"] for i in started(address)}:  # in the environment, never on a command line
            assert TOKEN.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
            assert f"{ADMIN_TOKEN_ENV}={TOKEN}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    finally:
        stop_mesh(proc, pids)
    logs = list(tmp_path.glob("*.log"))
    assert logs and not [log.name for log in logs if TOKEN in log.read_text(errors="replace")]


def test_every_process_listens_on_the_configured_interface_alone(tiny_checkpoint):
    """Every server of every process — gRPC, HTTP, metrics, rendezvous stores, gloo pairs of the CP and TP
    groups, the torch_p2p pairing store and KV groups, the expert attachment's store and groups — listens
    on `--host` (here 127.0.0.1), none on every interface."""
    folder, _ = tiny_checkpoint("qwen3_moe")
    proc, address = start_mesh(str(folder), "--experts", "1", "--expert-ep", "2", "--prefill-cp", "2",
                               "--decode-tp", "2", "--kv-transport", "torch_p2p", "--local-prefill-max-tokens", "0",
                               "--http-port", "0")
    pids = [i["pid"] for i in started(address)]
    try:
        answer = cli("generate", "the quick brown fox jumps over the lazy dog", "--target", address,
                     "--max-tokens", "4", "--ignore-eos")  # every group formed: CP, KV pairing, TP, experts
        assert answer.returncode == 0, answer.stderr
        every = [proc.pid, *descendants(proc.pid)]
        addresses = listening(every)
        assert len(every) >= 8 and addresses  # up, router, prefill and its rank, decode and its rank, experts
        assert {a for a in addresses if not a.startswith("127.0.0.1:")} == set()
    finally:
        stop_mesh(proc, pids)
