"""KV transfer throughput: one prompt's KV (SmolLM2 shapes: 30 layers, 3 KV heads, head_dim 64, bf16)
from a prefill cache (block 16) into reserved decode blocks (block 16), over each transport.

    python bench/kvtransfer.py [--tokens 2048] [--quick]

Rows: gRPC stream, shared memory and mooncake (a sending process and a serving one: over loopback, a Unix
socket, Mooncake's Transfer Engine on tcp), shared memory again with the sender's cache in /dev/shm
(`--shared-kv-cache`: decode copies straight from it), torch.distributed p2p over a gloo pair group (two
processes), each process on one intra-op thread; two floors of the same bytes: one gloo send of a single
tensor (for the network transports; timed alternately with the p2p pushes) and one single-threaded memcpy (for
shared memory; timed after each push from prefill's shared cache, so that floor and push share the host's
minute); and Mooncake's own `transfer_engine_bench` writing the same bytes (a batch of one write per layer's
keys and values, tcp, one thread) as the peer of the mooncake row. A push is what a prefill rank does:
`PlanSink` taking each layer and sending it.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import torch
import torch.multiprocessing as mp

sys.path[0] = str(Path(__file__).resolve().parents[1])  # repo root, not bench/: no script here shadows a package

from engine.heap import keep_freed_heap  # noqa: E402
from engine.kv_cache import KVStripe  # noqa: E402
from engine.parallel.groups import rendezvous, stateless_group  # noqa: E402
from kvtransfer import grpc_stream, mooncake, shared_memory, shm_arena  # noqa: E402
from kvtransfer.grpc_stream import GrpcStreamSender  # noqa: E402
from kvtransfer.plan import DecodeLayout, PrefillLayout  # noqa: E402
from kvtransfer.sink import PlanSink  # noqa: E402
from kvtransfer.torch_p2p import TorchP2PReceiver, TorchP2PSender, part_pair  # noqa: E402
from kvtransfer.transport import KVReceiver  # noqa: E402
from kvtransfer.transports import KVOptions  # noqa: E402
from mesh.rpc import Links  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
TCP = KVOptions("tcp", "")


def layouts(tokens: int):
    blocks = -(-tokens // BLOCK)
    src = PrefillLayout(token_ranges=(((0, tokens),),), num_kv_heads=HEADS, block_size=BLOCK,
                        block_table=tuple(range(blocks)))
    dst = DecodeLayout(head_ranges=((0, HEADS),), block_size=BLOCK, block_table=tuple(range(blocks, 2 * blocks)))
    return src, dst


def cache(blocks: int, memory=None):
    """Random KV, in `memory(shape, dtype)` when given (`shm_arena.shared_zeros`: a prefill's shared cache)."""
    shape = (blocks, BLOCK, HEADS, HEAD_DIM)
    place = memory or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    return [tuple(place(shape, torch.bfloat16).copy_(torch.randn(shape)) for _ in range(2)) for _ in range(LAYERS)]


def push(sender, kv, tokens: int) -> None:
    """A prefill rank's push of the prompt to one decode rank, as the engine drives it: `PlanSink`, layer by
    layer (the gather of each layer's rows included), then waiting for the acknowledgement."""
    src, dst = layouts(tokens)
    sink = PlanSink(num_tokens=tokens, num_kv_heads=HEADS, block_size=BLOCK, num_layers=LAYERS, target=dst,
                    senders=[sender])
    for layer, (k, v) in enumerate(kv):
        sink.push_layer(layer, k, v, src.block_table, KVStripe())
    sink.finish()


def serve_stream(module: str, tokens: int, addresses, stop) -> None:
    """The decode side of a transport of the gRPC stream protocol, in a process of its own (as decode runs): a
    gRPC server (`grpc_stream`) or a socket (`shared_memory`); its address goes into `addresses`."""
    keep_freed_heap()  # as every engine process (engine.heap)
    torch.set_num_threads(1)  # one core each, as p2p's ranks
    src, dst = layouts(tokens)
    receiver = KVReceiver(cache(2 * len(src.block_table)), lambda rid: dst.block_table)
    if module in (shared_memory.__name__, mooncake.__name__):
        links = Links("127.0.0.1", options=TCP) if module == mooncake.__name__ else None
        endpoint = sys.modules[module].Endpoint(0, 1, receiver, links=links, shared_address=None)
        addresses.put(endpoint.address)
        stop.wait()
        endpoint.stop()
        return
    server = grpc.server(futures.ThreadPoolExecutor(4))
    grpc_stream.add_to_server(grpc_stream.KVTransferService(receiver), server)
    addresses.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
    server.start()
    stop.wait()
    server.stop(None)


def bench_stream(transport, tokens: int, repeats: int, memory=None, floor=None) -> tuple[float, float | None]:
    """A transport (`grpc_stream`, `shared_memory`, `mooncake`): this process sends (from a cache in
    `memory`, see `cache`), a second one serves. Medians of the pushes and, when given, of
    `floor()`'s seconds timed after each push (a floor measured in the same minutes)."""
    spawn = mp.get_context("spawn")
    addresses, stop = spawn.SimpleQueue(), spawn.Event()
    server = spawn.Process(target=serve_stream, args=(transport.__name__, tokens, addresses, stop))
    server.start()
    src, _ = layouts(tokens)
    kv = cache(2 * len(src.block_table), memory)
    times, floors, threads = [], [], torch.get_num_threads()
    torch.set_num_threads(1)
    address = addresses.get()
    channel = grpc.insecure_channel(address) if transport is grpc_stream else None
    links = Links("127.0.0.1", options=TCP)
    try:
        for i in range(repeats + 1):  # the first warms up both ends
            if transport is mooncake:
                sender = mooncake.Dialer(0, 1, links).senders((address,), 0, f"r{i}", 60.0)[0]
            else:
                sender = (GrpcStreamSender(channel, f"r{i}", 0) if channel is not None
                          else shared_memory.SharedMemorySender(address, f"r{i}", 0))
            start = time.perf_counter()
            push(sender, kv, tokens)
            times.append(time.perf_counter() - start)
            if floor is not None and i:
                floors.append(floor())
    finally:
        torch.set_num_threads(threads)
        if channel is not None:
            channel.close()
        links.close()
        stop.set()
        server.join()
    return statistics.median(times[1:]), statistics.median(floors) if floors else None


def memcpy(total: int):
    """A callable timing one thread copying `total` bytes (numpy's copy: single-threaded), pages touched
    beforehand."""
    src, dst = np.frombuffer(np.random.bytes(total), dtype=np.uint8), np.empty(total, dtype=np.uint8)
    np.copyto(dst, src)

    def seconds() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    return seconds


def transfer_engine_bench(tokens: int, seconds: float) -> float:
    """Seconds for Mooncake's own benchmark to write a push's bytes: `transfer_engine_bench` (shipped in its
    wheel) between two processes on loopback, tcp, one thread, batches of 2 x LAYERS writes of one layer's keys
    (or values) each; its throughput over `seconds`, as the time of one batch."""
    binary = Path(mooncake_package()) / "transfer_engine_bench"
    common = [str(binary), "-metadata_server", "P2PHANDSHAKE", "-protocol", "tcp", "-local_server_name",
              "127.0.0.1", "-buffer_size", str(1 << 28)]
    env = dict(os.environ, MC_LOG_LEVEL="INFO")  # the target logs where it listens at INFO
    with tempfile.NamedTemporaryFile("w+") as log:
        target = subprocess.Popen(common + ["-mode", "target"], stderr=log, stdout=log, env=env)
        try:
            port = None
            while port is None and target.poll() is None:
                time.sleep(0.1)
                port = re.search(r"listening on 127\.0\.0\.1:(\d+)", Path(log.name).read_text())
            layer_bytes = tokens * HEADS * HEAD_DIM * 2
            out = subprocess.run(common + ["-mode", "initiator", "-segment_id", f"127.0.0.1:{port.group(1)}",
                                           "-operation", "write", "-block_size", str(layer_bytes), "-batch_size",
                                           str(2 * LAYERS), "-threads", "1", "-duration", str(int(seconds))],
                                 capture_output=True, text=True, check=True, env=env)
        finally:
            target.terminate()
            target.wait()
    gb_per_s = float(re.search(r"throughput ([\d.]+) GB/s", out.stderr).group(1))
    return 2 * LAYERS * layer_bytes / (gb_per_s * 1e9)


def mooncake_package() -> str:
    import mooncake as package  # the installed wheel's folder (this repository's module is kvtransfer.mooncake)

    return package.__path__[0]


def p2p_worker(rank: int, port: int, tokens: int, repeats: int, results) -> None:
    keep_freed_heap()
    torch.set_num_threads(1)
    group = stateless_group(rendezvous("127.0.0.1", port, rank, 2), "pair", rank, 2)
    src, dst = layouts(tokens)
    blocks = 2 * len(src.block_table)
    if rank == 1:
        TorchP2PReceiver(group, KVReceiver(cache(blocks), lambda rid: dst.block_table, on_landed=lambda rid: None),
                         sources=[0])  # as decode's: KV lands (nothing is freed)
        floor = torch.empty(LAYERS * 2 * tokens * HEADS * HEAD_DIM, dtype=torch.bfloat16)
        for _ in range(repeats):
            group.recv([floor], 0, 99).wait()
        part_pair(group, 1)  # leaves this process
    kv = cache(blocks)
    times, floors = [], []
    one_tensor = torch.randn(LAYERS * 2 * tokens * HEADS * HEAD_DIM).bfloat16()
    for i in range(repeats):  # alternating, so the host's drift moves both alike
        start = time.perf_counter()
        push(TorchP2PSender(group, f"r{i}", 1), kv, tokens)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        group.send([one_tensor], 1, 99).wait()
        floors.append(time.perf_counter() - start)
    part_pair(group, 1)
    results.put((statistics.median(times), statistics.median(floors)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    keep_freed_heap()  # this process sends, as a prefill rank
    tokens, repeats = (64, 2) if args.quick else (args.tokens, 5)
    total = LAYERS * 2 * tokens * HEADS * HEAD_DIM * 2
    (grpc_s, _), (shm_s, _) = bench_stream(grpc_stream, tokens, repeats), bench_stream(shared_memory, tokens, repeats)
    shm_cache_s, memcpy_s = bench_stream(shared_memory, tokens, repeats, shm_arena.shared_zeros, memcpy(total))
    mooncake_s, _ = bench_stream(mooncake, tokens, 3 * repeats)  # as noisy as p2p: as many
    engine_bench_s = transfer_engine_bench(tokens, 1 if args.quick else 5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(p2p_worker, args=(port, tokens, 3 * repeats, results), nprocs=2)  # noisier than the rest: more
    p2p_s, floor_s = results.get()
    print(f"### KV transfer, {tokens} tokens, {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM} bf16 "
          f"= {total / 1e6:.1f} MB, median of {repeats} (torch p2p and its floor: {3 * repeats}, alternating; "
          f"mooncake: {3 * repeats}; the memcpy timed after each push from prefill's shared cache; Mooncake's "
          f"transfer_engine_bench over "
          f"{1 if args.quick else 5} s)\n")
    print("| transport | seconds | GB/s | / its floor |\n|---|---|---|---|")
    for name, seconds, floor in (("gRPC stream (loopback)", grpc_s, floor_s),
                                 ("torch p2p (gloo pair group)", p2p_s, floor_s),
                                 ("floor: one gloo send of the same bytes", floor_s, floor_s),
                                 ("mooncake (Transfer Engine, tcp, loopback)", mooncake_s, engine_bench_s),
                                 ("peer: Mooncake's transfer_engine_bench, same bytes", engine_bench_s, engine_bench_s),
                                 ("shared memory (one host)", shm_s, memcpy_s),
                                 ("shared memory, read from prefill's shared cache", shm_cache_s, memcpy_s),
                                 ("floor: one-thread memcpy of the same bytes", memcpy_s, memcpy_s)):
        print(f"| {name} | {seconds:.3f} | {total / seconds / 1e9:.2f} | {floor / seconds:.2f} |")


if __name__ == "__main__":
    main()
