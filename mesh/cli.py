"""The `infermesh` command line: run the engine or a mesh here (`generate`, `up`, `demo`); look at and
change a running mesh (`status`, `drain`, `scale`: `mesh.cli_admin`).

    infermesh generate "What is the capital of France?" --chat
    infermesh generate "Once upon a time" --max-tokens 64 --temperature 0.8 --seed 1 --json

`generate` runs the engine in this process and streams text to stdout as it is
produced; `--json` then prints one JSON object on the last line. Bad arguments
exit with code 2 and a one-line message on stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Optional

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # read as grpc loads (cli_admin loads it): no gRPC notices

import typer

from engine.engine_config import DEFAULTS as ENGINE
from engine.limits import DEFAULT_MAX_TOKENS
from mesh import cli_admin, tls
from mesh.mesh_spec import MeshSpec

SPEC = MeshSpec()  # the defaults of `up`, and of the settings every command shares (mesh.settings)
app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="infermesh: serve LLMs as a mesh of disaggregated roles.")


@app.callback()
def main() -> None:
    """infermesh admin CLI."""


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt (a user message with --chat)."),
    model: str = typer.Option(SPEC.model, help="Bundled model name or path to a GGUF file / HF folder."),
    chat: bool = typer.Option(False, "--chat", help="Apply the model's chat template to PROMPT as a user message."),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens; 0 disables."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep generating past end-of-sequence."),
    dtype: str = typer.Option(ENGINE.dtype, help="float32 | bfloat16 | float16."),
    quantization: str = typer.Option(ENGINE.quantization, help="none | int8 (weight-only: faster decode at few "
                                                               "streams)."),
    batch_invariant: bool = typer.Option(ENGINE.batch_invariant, "--batch-invariant/--no-batch-invariant",
                                         help="Off: faster CPU decode in float32 at 1-8 rows (engine/model.py, "
                                              "Linear) and of int8 weights at 2-64 rows on AMX (engine/quantize.py)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (local processes)."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel ranks (local processes)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel ranks (MoE models; 1 or equal to --tp)."),
    cp_method: str = typer.Option("auto", help="auto | pass_kv | pass_q: how CP prefill attends."),
    target: Optional[str] = typer.Option(None,
                                         help="HOST:PORT of a running mesh's router (else: run the engine here)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object with ids, usage and timings last."),
) -> None:
    """Generate text for PROMPT, streaming it as it is produced."""
    if not prompt:
        _fail("prompt must not be empty")
    from engine.sampling_params import SamplingParams  # torch-free: checked here for both paths

    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    ignore_eos=ignore_eos)
    try:
        params = SamplingParams(**sampling)
    except ValueError as e:
        _fail(str(e))
    start = time.monotonic()
    if target:
        ids, deltas = _remote_stream(target, prompt, chat, sampling)
    else:
        options = dict(tp=tp, cp=cp, ep=ep, cp_method=cp_method, quantization=quantization,
                       batch_invariant=batch_invariant)
        ids, deltas = _local_stream(prompt, chat, params, model, dtype, options)
    first, token_ids, text, reason = None, [], "", None
    for delta_ids, delta_text, finish in deltas:
        first = first or time.monotonic()
        token_ids += delta_ids
        text += delta_text
        reason = finish or reason
        sys.stdout.write(delta_text)
        sys.stdout.flush()
    end = time.monotonic()
    sys.stdout.write("\n")
    if as_json:
        ids = ids() if callable(ids) else ids
        decode_s = end - (first or end)
        result = {
            "text": text,
            "token_ids": token_ids,
            "prompt_token_ids": ids,
            "finish_reason": reason,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(token_ids)},
            "timings": {"ttft_s": round((first or end) - start, 4),
                        "tokens_per_s": round((len(token_ids) - 1) / decode_s, 2) if decode_s > 0 else 0.0},
        }
        sys.stdout.write(json.dumps(result) + "\n")


def _local_stream(prompt: str, chat: bool, params, model: str, dtype: str, options: dict):
    """(prompt ids, iterator of (token ids, text, finish reason)) from an engine in this process."""
    from engine import LLM
    from engine.parallel.launcher import ParallelError

    try:
        llm = LLM(model, dtype=dtype, **options)
    except ValueError as e:  # every engine input error (params, request, weights, config, layout) is a ValueError
        _fail(str(e))
    try:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else llm.tokenizer.encode(prompt)
    except ValueError as e:
        llm.close()
        _fail(str(e))

    def deltas():
        try:
            for delta in llm.stream(ids, params):
                yield delta.token_ids, delta.text, delta.finish_reason
        except ValueError as e:
            _fail(str(e))
        except ParallelError as e:  # a rank of a parallel engine failed: its first line, exit 1
            typer.echo(f"error: {str(e).splitlines()[0]}", err=True)
            raise typer.Exit(code=1) from None
        finally:
            llm.close()

    return ids, deltas()


def _remote_stream(target: str, prompt: str, chat: bool, sampling: dict):
    """The same, through a mesh's router over gRPC."""
    import grpc

    from mesh import rpc
    from protos.convert import FINISH_REASONS
    from protos.infermesh.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceStub(rpc.channel(target))
    params = common_pb2.SamplingParams(**sampling)
    if chat:
        call = stub.Chat(inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(role="user", content=prompt)],
                                                   sampling=params))
    else:
        call = stub.Generate(inference_pb2.GenerateRequest(text=prompt, sampling=params))
    final: list = []
    reasons = {v: k for k, v in FINISH_REASONS.items()}

    def deltas():
        try:
            for response in call:
                if response.HasField("delta"):
                    yield list(response.delta.token_ids), response.delta.text, None
                else:
                    final.append(response.final)
                    yield [], "", reasons.get(response.final.finish_reason)
        except grpc.RpcError as e:
            code = e.code()
            message = f"{code.name}: {e.details()}"
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                _fail(message)
            typer.echo(f"error: {message}", err=True)
            raise typer.Exit(code=1) from None

    return (lambda: list(final[0].prompt_token_ids) if final else []), deltas()


@app.command()
def up(
    model: str = typer.Option(SPEC.model, help="Bundled model name or path to a GGUF file / HF folder."),
    host: str = typer.Option(SPEC.host, help="Interface every process binds."),
    port: int = typer.Option(SPEC.port, help="The router's public port (0: any free port)."),
    http_port: Optional[int] = typer.Option(
        None, help="Also serve the OpenAI-compatible HTTP API on this port (0: any free port)."),
    prefill: int = typer.Option(1, help="Prefill instances (0: decode instances prefill everything)."),
    prefill_cp: int = typer.Option(1, help="Context-parallel ranks per prefill instance."),
    decode: int = typer.Option(1, help="Decode instances."),
    decode_tp: int = typer.Option(1, help="Tensor-parallel ranks per decode instance."),
    local_prefill_max_tokens: int = typer.Option(
        SPEC.local_prefill_max_tokens, help="Prompts whose uncached part is at most this many tokens are prefilled "
                                            "on decode."),
    kv_transport: str = typer.Option(
        SPEC.kv_transport, help="grpc_stream | torch_p2p | shared_memory (one host) | mooncake: how prefill "
                                "pushes KV to decode."),
    mooncake_protocol: str = typer.Option(SPEC.mooncake_protocol, help="The mooncake transport's: tcp | rdma."),
    mooncake_devices: str = typer.Option(SPEC.mooncake_devices, help="RDMA NICs for mooncake over rdma, e.g. "
                                                                     "mlx5_0,mlx5_1 (empty: Mooncake picks)."),
    kv_pool: str = typer.Option(SPEC.kv_pool, help="none | mooncake (start one here) | mooncake://HOST:PORT (a "
                                                   "Mooncake Store master): a KV pool every engine instance of one "
                                                   "rank stores blocks to and loads prompts' blocks from."),
    kv_pool_memory: str = typer.Option(SPEC.kv_pool_memory, help="What the pool `--kv-pool mooncake` starts "
                                                                 "holds, e.g. '4 GB'."),
    experts: int = typer.Option(0, help="Expert instances hosting an MoE model's experts (0: inside each instance)."),
    expert_ep: int = typer.Option(1, help="Expert-parallel ranks per expert instance."),
    registry: str = typer.Option(SPEC.registry, help="memory (served by this process) | redis://HOST:PORT"),
    trace: str = typer.Option(SPEC.trace, help="none | console | otlp | file:PATH"),
    metrics: str = typer.Option(SPEC.metrics, help="OpenTelemetry metrics: none | console | otlp | file:PATH"),
    dtype: str = typer.Option(SPEC.dtype, help="float32 | bfloat16 | float16."),
    quantization: str = typer.Option(SPEC.quantization, help="none | int8 (prefill and decode weights)."),
    batch_invariant: bool = typer.Option(SPEC.batch_invariant, "--batch-invariant/--no-batch-invariant",
                                         help="Off: faster CPU decode in float32 at 1-8 streams and of int8 "
                                              "weights at 2-64 on AMX; a row's result then depends on its batch "
                                              "(engine/model.py, Linear; engine/quantize.py)."),
    max_num_batched_tokens: int = typer.Option(
        SPEC.max_num_batched_tokens, help="Tokens an engine step takes (prompt chunks and decode rows): smaller "
                                          "chunks a long prompt's prefill, so streams decoding beside it wait less "
                                          "per step, and it takes longer."),
    kv_cache_bytes: int = typer.Option(SPEC.kv_cache_bytes, help="KV cache memory of each prefill and decode "
                                                                 "instance (each rank)."),
    cpus: str = typer.Option(SPEC.cpus, help="split: each engine instance its own share of this host's cores "
                                           "(by ranks), a one-rank decode instance running steps on prefill's "
                                           "while they idle; shared: every instance may use every core."),
    max_restarts: int = typer.Option(SPEC.max_restarts, help="Restarts of a crashed process within "
                                                               "--restart-window-s before it is left down "
                                                               "(back-off doubling from 1 s; 0: never restart)."),
    restart_window_s: float = typer.Option(SPEC.restart_window_s, help="The window --max-restarts counts in."),
    log_dir: Optional[str] = typer.Option(None, help="Where each process logs (default: a new temp folder)."),
    admin_token: str = typer.Option("", envvar="INFERMESH_ADMIN_TOKEN", show_default=False,
                                    help="Scale and drain need this bearer token (prefer the variable)."),
) -> None:
    """Start the whole mesh on this host and serve until Ctrl-C (every process it started is stopped); a process
    that crashes is restarted (`infermesh status` shows restarts and why one was left down)."""
    spec = dict(model=model, host=host, port=port, http_port=http_port, prefill=prefill, prefill_cp=prefill_cp,
                decode=decode, decode_tp=decode_tp, local_prefill_max_tokens=local_prefill_max_tokens,
                kv_transport=kv_transport, mooncake_protocol=mooncake_protocol, mooncake_devices=mooncake_devices,
                kv_pool=kv_pool, kv_pool_memory=kv_pool_memory,
                experts=experts, expert_ep=expert_ep, registry=registry, trace=trace,
                metrics=metrics, dtype=dtype, quantization=quantization, batch_invariant=batch_invariant, cpus=cpus,
                max_num_batched_tokens=max_num_batched_tokens, kv_cache_bytes=kv_cache_bytes, admin_token=admin_token,
                max_restarts=max_restarts, restart_window_s=restart_window_s)
    with _mesh(spec, log_dir) as (supervisor, stop):
        while not stop.wait(0.5):
            for event in supervisor.watch():
                typer.echo(f"{time.strftime('%H:%M:%S')} {event}")


@app.command()
def demo(
    prompt: str = typer.Option("What is the capital of France?", help="Asked as a chat message."),
    model: str = typer.Option(SPEC.model, help="Bundled model name or path to a GGUF file / HF folder."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16."),
) -> None:
    """Start a local mesh (a prefill instance of two context-parallel ranks, one decode instance, a router),
    stream one answer through it — prefilled by both CP ranks, its KV pushed to decode — and stop it.

    float32 by default: on the demo question SmolLM2's first two candidates ("The", "L") are 0.08 apart,
    less than bf16's logit step there (0.125), so a bf16 answer depends on rounding order."""
    spec = dict(model=model, port=0, prefill=1, prefill_cp=2, decode=1, local_prefill_max_tokens=0, dtype=dtype)
    with _mesh(spec, None) as (supervisor, _):
        ids, deltas = _remote_stream(supervisor.router_address, prompt, True, dict(max_tokens=128, temperature=0.0))
        for _, text, _ in deltas:
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")


@contextlib.contextmanager
def _mesh(spec: dict, log_dir: str | None):
    """A started Supervisor and a stop event set by SIGINT/SIGTERM; everything stopped on exit."""
    import signal
    import threading

    from mesh.supervisor import MeshError, Supervisor

    try:
        supervisor = Supervisor(MeshSpec(**spec), log_dir)
    except ValueError as e:
        _fail(str(e))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        address = supervisor.start()
        scheme = "https" if tls.identity() else "http"  # the front speaks TLS when the mesh does
        http = f"OpenAI API: {scheme}://{supervisor.http_address}/v1; " if supervisor.http_address else ""
        typer.echo(f"infermesh ready on {address}  ({http}logs: {supervisor.log_dir})")
        yield supervisor, stop
    except MeshError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    finally:
        supervisor.stop()


@app.command()
def rank(
    join: str = typer.Option(..., help="HOST:PORT of the instance's rendezvous (where its rank 0 runs)."),
    rank: int = typer.Option(..., "--rank", help="The first rank to run here."),
    count: int = typer.Option(1, help="How many ranks to run here: RANK .. RANK+COUNT-1."),
    host: str = typer.Option("127.0.0.1", help="The address these ranks bind (this host's, as its peers see it)."),
) -> None:
    """Run ranks of an instance whose rank 0 runs elsewhere (a LeaderWorkerSet worker); exit when they do."""
    from engine.cpus import available_cores
    from engine.parallel.launcher import spawn_rank

    if rank < 1 or count < 1:
        _fail(f"need --rank >= 1 (rank 0 hosts the rendezvous) and --count >= 1, got {rank} and {count}")
    threads = max(1, len(available_cores()) // count)
    processes = [spawn_rank(join, r, host, threads, os.getpid()) for r in range(rank, rank + count)]
    codes = [p.wait() for p in processes]
    raise typer.Exit(code=next((c for c in codes if c), 0))


app.command()(cli_admin.status)
app.command()(cli_admin.drain)
app.command()(cli_admin.scale)
app.command()(cli_admin.plan)


if __name__ == "__main__":
    app()
