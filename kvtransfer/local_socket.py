"""Pushes over a Unix socket, for a sender and a receiver on one host: the channel of the `shared_memory`
transport, whose messages only say where the KV lies. A gRPC stream of four small messages takes ~1.2 ms
on an idle host (~3.5 ms of a 10 ms push when both processes copy), this channel ~0.25 ms.

    sender:   connect, header (MAGIC, its timeout in ms), frames (4-byte little-endian length + bytes),
              an empty frame (the end)
    receiver: one reply frame: b"\\0" + the reply, or b"\\1" + "<error type>: <message>"; then it closes

A push the receiver refuses ends at the refusal: it answers at once and closes, and the sender's next write
or its wait for the reply reads the refusal. A sender that goes away mid-push is dropped without an answer;
one that does not end its push within its timeout is answered `DeadlineExceeded`. The receiver's socket
lives in a directory the caller names (the transport's: /dev/shm), as `<prefix><pid>-<random>.sock`, mode
0600 (only the user's own processes may push, as only they may read the staging files); `close` or the
process's exit removes it, and one of a killed process is swept with the staging files (`shm_arena.sweep`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import socket
import struct
import threading
import time
from typing import Callable, Iterator

from engine.errors import DeadlineExceeded, RequestError, ServingError
from kvtransfer.transport import TransferError

MAGIC = b"IMKV"
MAX_FRAME_BYTES = 16 << 20  # a message names where KV lies: a few KB even for a long prompt
MAX_PUSHES = 512  # in flight on one server (a gRPC server's default); the next is refused as Overloaded
_LENGTH = struct.Struct("<I")


class Connection:
    """One push's sending end: `send` frames, then `finish` for the reply. Each raises TransferError
    naming `name` (what is pushed to whom) when the push failed, with the receiver's refusal if it sent one."""

    def __init__(self, path: str, timeout_s: float, name: str) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)  # a receiver that stops reading cannot hold the sender longer
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise TransferError(f"{name}: cannot connect to {path}: {e.strerror or e} (is the receiver on this "
                                f"host?)") from None
        self._write(MAGIC + _LENGTH.pack(min(max(1, round(timeout_s * 1000)), 2**32 - 1)))  # ms: 49 days at most

    def send(self, frame: bytes) -> None:
        if not frame:
            raise ValueError("a frame carries at least one byte (an empty one ends the push)")
        self._write(_LENGTH.pack(len(frame)) + frame)

    def _write(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except TimeoutError:
            self.close()
            raise TransferError(f"{self.name}: the receiver took no data for {self.timeout_s} s") from None
        except OSError:  # the receiver ended the push: its refusal is waiting to be read
            self._reply(self.timeout_s)
            raise TransferError(f"{self.name} ended early") from None

    def finish(self, timeout_s: float) -> bytes:
        """End the push and wait up to `timeout_s` for the reply; its bytes."""
        with contextlib.suppress(OSError):  # a receiver that already answered: read its answer below
            self._sock.sendall(_LENGTH.pack(0))
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> bytes:
        try:
            self._sock.settimeout(timeout_s)
            (length,) = _LENGTH.unpack(read_exactly(self._sock, _LENGTH.size))
            if length > MAX_FRAME_BYTES:
                raise TransferError(f"{self.name}: a reply of {length} bytes is not one of ours")
            body = read_exactly(self._sock, length)
        except TimeoutError:
            raise TransferError(f"{self.name} not acknowledged within {timeout_s} s") from None
        except (OSError, EOFError) as e:
            raise TransferError(f"{self.name} failed: the receiver closed the connection without an answer "
                                f"({e!r}: did it exit?)") from None
        finally:
            self.close()
        if body[:1] != b"\0":
            raise TransferError(f"{self.name} failed: {body[1:].decode(errors='replace')}")
        return body[1:]

    def close(self) -> None:
        self._sock.close()


class Server:
    """Takes pushes on a Unix socket at `path`, each on a thread of its own (`thread_init` runs first on it), at
    most `max_pushes` at once: `handle(frames)` consumes the push's frames (an iterator of bytes) and returns
    the reply; what it raises is the refusal, named by its type (`engine.errors`). `close()` stops taking
    pushes and ends those in flight; it is safe twice."""

    def __init__(self, directory: str, prefix: str, handle: Callable[[Iterator[bytes]], bytes],
                 thread_init: Callable[[], None] | None = None, max_pushes: int = MAX_PUSHES) -> None:
        self.handle, self.thread_init, self.max_pushes = handle, thread_init, max_pushes
        self.path = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(6)}.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)  # bound 0755 or narrower under any usual umask: nobody else could connect
        self._listener.listen(64)
        self._open: set[socket.socket] = set()  # connections being served
        self._threads: set[threading.Thread] = set()
        self._lock, self._closed = threading.Lock(), False
        self._acceptor = threading.Thread(target=self._accept, name="kv-push-accept", daemon=True)
        self._acceptor.start()
        atexit.register(self.close)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                full = len(self._open) >= self.max_pushes
                if not full:
                    thread = threading.Thread(target=self._serve, args=(conn,), name="kv-push", daemon=True)
                    self._open.add(conn)
                    self._threads.add(thread)
            if full:
                _refuse(conn, f"Overloaded: this receiver serves at most {self.max_pushes} pushes at once")
            else:
                thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.thread_init is not None:
                self.thread_init()
            conn.settimeout(10.0)  # for the header
            header = read_exactly(conn, len(MAGIC) + _LENGTH.size)
            if header[:len(MAGIC)] != MAGIC:
                reply = b"\1RequestError: not a KV push (wrong header)"
            else:
                timeout_s = _LENGTH.unpack(header[len(MAGIC):])[0] / 1000
                try:
                    reply = b"\0" + self.handle(frames(conn, time.monotonic() + timeout_s, timeout_s))
                except (OSError, EOFError):
                    return  # the sender went away mid-push: nobody to answer
                except Exception as e:
                    reply = b"\1" + describe(e).encode()
            _answer(conn, reply)
        except (OSError, EOFError):
            pass  # the sender went away: nobody to answer
        finally:
            conn.close()
            with self._lock:
                self._open.discard(conn)
                self._threads.discard(threading.current_thread())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in self._open:  # ends their reads: their handlers fail and their threads end
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        for thread in [self._acceptor, *threads]:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        atexit.unregister(self.close)


def _answer(conn: socket.socket, reply: bytes) -> None:
    conn.settimeout(1.0)
    conn.sendall(_LENGTH.pack(len(reply)) + reply)


def _refuse(conn: socket.socket, why: str) -> None:
    """Answer a push with a refusal before reading it, and close."""
    with conn, contextlib.suppress(OSError):
        _answer(conn, b"\1" + why.encode())


def frames(conn: socket.socket, deadline: float, timeout_s: float) -> Iterator[bytes]:
    """A push's frames as they come, until its end; DeadlineExceeded past `deadline`, EOFError if the sender
    went away."""
    while True:
        try:
            conn.settimeout(max(deadline - time.monotonic(), 1e-3))
            (length,) = _LENGTH.unpack(read_exactly(conn, _LENGTH.size))
            if length > MAX_FRAME_BYTES:
                raise RequestError(f"a frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
            if not length:
                return
            yield read_exactly(conn, length)
        except TimeoutError:
            raise DeadlineExceeded(f"the push did not end within its timeout of {timeout_s} s") from None


def read_exactly(sock: socket.socket, n: int) -> bytes:
    """`n` bytes from `sock`; EOFError if it closes first."""
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        read = sock.recv_into(view[got:])
        if not read:
            raise EOFError(f"connection closed after {got} of {n} bytes")
        got += read
    return bytes(data)


def describe(error: Exception) -> str:
    """The refusal's words: its type (one of `engine.errors` or a subclass) and its message."""
    return f"{type(error).__name__}: {error}" if isinstance(error, ServingError) else f"internal error: {error!r}"
