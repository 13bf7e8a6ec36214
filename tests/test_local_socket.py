"""The shared-memory transport's channel (`kvtransfer.local_socket`) over real Unix sockets: a push's frames
reach the handler in order and its reply comes back; a refusal names its type; and every way a push can go
wrong ends it clearly on both ends, with no thread or socket file left behind: a receiver that never answers,
a sender that never ends, a sender killed mid-push, a receiver stopped mid-push, a stranger's bytes."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

from engine.errors import NoReservation
from kvtransfer import local_socket
from kvtransfer.transport import TransferError
from tests.helpers import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def push_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-push"]


@pytest.fixture
def server(tmp_path):
    """A server whose handler joins a push's frames (refusing one that says b"refuse"), and what it saw."""
    seen: list[list[bytes]] = []

    def handle(frames) -> bytes:
        got = []
        seen.append(got)
        for frame in frames:
            if frame == b"refuse":
                raise NoReservation("request 'x' has no KV reservation here")
            got.append(frame)
        return b"|".join(got)

    server = local_socket.Server(str(tmp_path), "kv-", handle)
    yield server, seen
    server.close()
    assert not os.path.exists(server.path)
    wait_until(lambda: not push_threads())


def test_frames_arrive_in_order_and_the_reply_comes_back_from_a_socket_only_its_user_may_use(server):
    server, seen = server
    assert stat.S_ISSOCK(os.stat(server.path).st_mode) and stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    assert os.path.basename(server.path).startswith(f"kv-{os.getpid()}-")  # swept by its pid once it is gone
    for _ in range(2):  # one connection a push
        connection = local_socket.Connection(server.path, 10.0, "push")
        for frame in (b"a", b"c" * 100_000):
            connection.send(frame)
        assert connection.finish(10.0) == b"a|" + b"c" * 100_000
    assert len(seen) == 2


def test_a_refusal_ends_the_push_with_its_type_and_the_server_keeps_serving(server):
    server, _ = server
    connection = local_socket.Connection(server.path, 10.0, "KV push to rank 0")
    connection.send(b"refuse")
    with pytest.raises(TransferError, match="KV push to rank 0 failed: NoReservation: request 'x' has no KV"):
        for _ in range(1000):  # the refusal is read at the first write after it, or at the end
            connection.send(b"more")
        connection.finish(10.0)
    again = local_socket.Connection(server.path, 10.0, "push")
    again.send(b"ok")
    assert again.finish(10.0) == b"ok"


def test_a_push_past_the_servers_limit_is_refused_as_overloaded_and_the_next_served(tmp_path):
    server = local_socket.Server(str(tmp_path), "kv-", lambda frames: b"|".join(frames), max_pushes=1)
    try:
        first = local_socket.Connection(server.path, 10.0, "push")
        first.send(b"a")
        wait_until(lambda: len(push_threads()) == 1)  # in flight
        with pytest.raises(TransferError, match="KV push to rank 0 failed: Overloaded: this receiver serves at "
                                                "most 1 pushes at once"):  # read at the first write after it
            second = local_socket.Connection(server.path, 10.0, "KV push to rank 0")
            second.send(b"b")
            second.finish(10.0)
        assert first.finish(10.0) == b"a"
        wait_until(lambda: not push_threads())
        third = local_socket.Connection(server.path, 10.0, "push")
        third.send(b"c")
        assert third.finish(10.0) == b"c"
    finally:
        server.close()


def test_a_receiver_that_never_answers_fails_the_push_within_its_timeout(tmp_path):
    path = str(tmp_path / "hung.sock")
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(path)
    hung.listen(1)  # connections complete in the backlog; nobody ever reads them
    try:
        connection = local_socket.Connection(path, 1.0, "KV push to rank 0")
        connection.send(b"layer")
        started = time.monotonic()
        with pytest.raises(TransferError, match="KV push to rank 0 not acknowledged within 0.5 s"):
            connection.finish(0.5)
        assert time.monotonic() - started < 5
    finally:
        hung.close()


def test_a_sender_that_never_ends_its_push_is_answered_past_its_timeout(server):
    server, seen = server
    connection = local_socket.Connection(server.path, 0.3, "push")
    connection.send(b"layer")  # and nothing more for longer than its timeout: a prefill rank stuck mid-push
    wait_until(lambda: seen == [[b"layer"]])
    wait_until(lambda: not push_threads())  # answered, and its thread ended
    with pytest.raises(TransferError, match="DeadlineExceeded: the push did not end within its timeout of 0.3 s"):
        connection.finish(10.0)


def test_a_sender_killed_mid_push_is_dropped_and_the_next_push_served(server):
    server, seen = server
    code = ("import sys, time\nfrom kvtransfer import local_socket\n"
            "c = local_socket.Connection(sys.argv[1], 60.0, 'push')\nc.send(b'layer')\n"
            "print('sent', flush=True)\ntime.sleep(60)\n")
    sender = subprocess.Popen([sys.executable, "-c", code, server.path], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert sender.stdout.readline().strip() == "sent"
        wait_until(lambda: seen and seen[0] == [b"layer"])
        assert len(push_threads()) == 1
        sender.kill()  # SIGKILL: the kernel closes its end
        sender.wait()
        wait_until(lambda: not push_threads())  # the handler saw the end of the stream and returned
    finally:
        sender.kill()
    connection = local_socket.Connection(server.path, 10.0, "push")
    connection.send(b"next")
    assert connection.finish(10.0) == b"next"


def test_a_receiver_stopped_mid_push_fails_the_push_and_leaves_no_thread(tmp_path):
    entered = threading.Event()

    def handle(frames) -> bytes:
        for _ in frames:
            entered.set()
        return b"never"

    server = local_socket.Server(str(tmp_path), "kv-", handle)
    connection = local_socket.Connection(server.path, 10.0, "KV push to rank 1")
    connection.send(b"layer")
    assert entered.wait(10)
    server.close()  # decode stops (or dies) with the push in flight
    with pytest.raises(TransferError, match="KV push to rank 1 failed: the receiver closed the connection without"):
        connection.finish(10.0)
    assert not push_threads() and not os.path.exists(server.path)
    with pytest.raises(TransferError, match="cannot connect to .*: No such file or directory"):
        local_socket.Connection(server.path, 1.0, "push")
    server.close()  # safe twice


def test_bytes_that_are_not_a_push_are_refused(server):
    server, seen = server
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stranger:
        stranger.connect(server.path)
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
        length = int.from_bytes(local_socket.read_exactly(stranger, 4), "little")
        assert local_socket.read_exactly(stranger, length) == b"\1RequestError: not a KV push (wrong header)"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as huge:
        huge.connect(server.path)
        huge.sendall(local_socket.MAGIC + (1000).to_bytes(4, "little") + (1 << 30).to_bytes(4, "little"))
        length = int.from_bytes(local_socket.read_exactly(huge, 4), "little")
        assert local_socket.read_exactly(huge, length) == (
            f"\1RequestError: a frame of {1 << 30} bytes is over the limit of {local_socket.MAX_FRAME_BYTES}".encode())
    assert not any(seen[-1])
