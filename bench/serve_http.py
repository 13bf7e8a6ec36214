"""A load generator we did not write (NVIDIA's `aiperf`) against the router's OpenAI-compatible HTTP front,
next to the same requests through the gRPC API, in one run on one mesh.

    pip install aiperf            # in a virtual environment of its own: it is not a test dependency
    python bench/serve_http.py --aiperf /path/to/venv/bin/aiperf [--concurrency 4] [--requests 16]

Starts `infermesh up --prefill 0 --http-port 0` (one decode instance that also prefills), writes the model's
tokenizer.json for aiperf, runs `aiperf profile --endpoint-type chat --streaming` (synthetic prompts of
`--isl` tokens, `--osl` output tokens with ignore_eos, fixed concurrency, after 2 warm-up requests), then
replays aiperf's exact chat payloads with the same concurrency from a thread pool in this process, through
the HTTP front (httpx) and through the gRPC `Chat` API: the HTTP row separates the front's cost from
aiperf's own (its worker processes share the machine's cores with the mesh, as every client here does).
Reports TTFT and inter-token latency (avg / p50 / p99, ms), output tokens/s and requests/s of each, as a
markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.model_info import load_model_info  # noqa: E402
from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc  # noqa: E402

INFERMESH = str(Path(sys.executable).parent / "infermesh")


def start_mesh(model: str, dtype: str, log_dir: str) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([INFERMESH, "up", "--model", model, "--dtype", dtype, "--port", "0", "--http-port", "0",
                             "--prefill", "0", "--log-dir", log_dir], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("infermesh ready on "):
            grpc_address = line.split()[3]
            http_address = re.search(r"http://([^/]+)/v1", line).group(1)
            return proc, grpc_address, http_address
    raise RuntimeError(f"the mesh did not start; logs in {log_dir}")


def export_tokenizer(model: str, folder: Path) -> None:
    """tokenizer.json (+ its chat template) of the served model, for aiperf's client-side token counts."""
    _, tokenizer = load_model_info(model)
    tokenizer._backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template}))


def run_aiperf(aiperf: str, model: str, http: str, tokenizer: Path, out: Path, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # its offline mode refuses local folders
    cmd = [aiperf, "profile", "--model", model, "--url", f"http://{http}", "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer), "--ui-type", "none", "--concurrency", str(args.concurrency),
           "--request-count", str(args.requests), "--warmup-request-count", "2",
           "--prompt-input-tokens-mean", str(args.isl), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(args.osl), "--prompt-output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--random-seed", "0", "--artifact-dir", str(out),
           "--no-server-metrics"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    return {"ttft": report["time_to_first_token"], "itl": report["inter_token_latency"],
            "tokens_per_s": report["output_token_throughput"]["avg"],
            "requests_per_s": report["request_throughput"]["avg"]}


def grpc_client(address: str, osl: int):
    """One chat request through gRPC Chat: the arrival time of each token."""
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
    sampling = common_pb2.SamplingParams(max_tokens=osl, temperature=1.0, ignore_eos=True)

    def one(messages: list[dict]) -> list[float]:
        request = inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                      for m in messages], sampling=sampling)
        return [time.perf_counter() for r in stub.Chat(request, timeout=600)
                if r.HasField("delta") and r.delta.token_ids]

    return one


def http_client(address: str, model: str, osl: int):
    """One chat request through the HTTP front (httpx, server-sent events): the arrival time of each token."""
    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64))

    def one(messages: list[dict]) -> list[float]:
        body = {"model": model, "messages": messages, "max_tokens": osl, "ignore_eos": True, "stream": True}
        stamps = []
        with client.stream("POST", f"http://{address}/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    stamps.append(time.perf_counter())
        return stamps

    return one


def replay(one, payloads: list[dict], concurrency: int) -> dict:
    """aiperf's payloads through `one(messages) -> token arrival times`, `concurrency` at a time."""
    def timed(messages: list[dict]):
        start = time.perf_counter()
        stamps = one(messages)
        return stamps[0] - start, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1), len(stamps)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(timed, [p["messages"] for p in payloads[:2]]))  # warm-up, as aiperf
        start = time.perf_counter()
        results = list(pool.map(timed, [p["messages"] for p in payloads]))
        duration = time.perf_counter() - start
    ttfts, itls = [r[0] * 1000 for r in results], [r[1] * 1000 for r in results]
    return {"ttft": summary(ttfts), "itl": summary(itls), "tokens_per_s": sum(r[2] for r in results) / duration,
            "requests_per_s": len(results) / duration}


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"avg": statistics.fmean(values), "p50": statistics.median(values),
            "p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def row(name: str, r: dict) -> str:
    return (f"| {name} | {r['ttft']['avg']:.0f} / {r['ttft']['p50']:.0f} / {r['ttft']['p99']:.0f} "
            f"| {r['itl']['avg']:.1f} / {r['itl']['p50']:.1f} / {r['itl']['p99']:.1f} "
            f"| {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serve-http-"))
    (work / "tokenizer").mkdir()
    export_tokenizer(args.model, work / "tokenizer")
    proc, grpc_address, http_address = start_mesh(args.model, args.dtype, str(work / "logs"))
    try:
        http = run_aiperf(args.aiperf, args.model, http_address, work / "tokenizer", work / "aiperf", args)
        payloads = [p for s in json.loads((work / "aiperf" / "inputs.json").read_text())["data"] for p in s["payloads"]]
        payloads = payloads[:args.requests]
        via_http = replay(http_client(http_address, args.model, args.osl), payloads, args.concurrency)
        via_grpc = replay(grpc_client(grpc_address, args.osl), payloads, args.concurrency)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    print(f"### {args.model} {args.dtype}, one decode instance (prefills too), {args.requests} chat requests, "
          f"concurrency {args.concurrency}, ~{args.isl} prompt tokens (aiperf's), {args.osl} output tokens\n")
    print("| client | TTFT ms avg / p50 / p99 | inter-token ms avg / p50 / p99 | output tok/s | requests/s |")
    print("|---|---|---|---|---|")
    print(row("aiperf → OpenAI HTTP front", http))
    print(row("the same payloads → HTTP front (httpx, this process)", via_http))
    print(row("the same payloads → gRPC Chat (this process)", via_grpc))


if __name__ == "__main__":
    main()
