"""What many tests share: waiting for a state, free ports, KV blocks in use, and the processes below one."""

from __future__ import annotations

import ipaddress
import socket
import time
from pathlib import Path

import psutil

from protos.infermesh.v1 import internal_pb2


def wait_until(condition, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; fail the test if it does not within `timeout_s` (a bound that keeps a
    test from hanging, never the thing tested)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(0.02)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kv_blocks_used(admin) -> int:
    """The KV blocks an instance holds, from its Admin.Status (`admin`: an AdminStub)."""
    return admin.Status(internal_pb2.StatusRequest(), timeout=10).kv_blocks_used


def assert_exited(pids: list[int], timeout_s: float = 10.0) -> None:
    """Each process is gone or a zombie (exited, waiting for its reaper: init for an orphaned rank, and this
    machine's init reaps late); one killed through PR_SET_PDEATHSIG may take a moment."""
    def exited(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except FileNotFoundError:
            return True

    deadline = time.monotonic() + timeout_s
    while not all(map(exited, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in pids if not exited(pid)] == []


def task_files(pid: int, name: str) -> list[str]:
    """/proc/PID/task/*/`name` of each thread of `pid` still there when read: a thread or a process that ends
    between the listing and the read is left out (suite runs met both)."""
    texts = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return texts
    for task in tasks:
        try:
            texts.append((task / name).read_text())
        except (FileNotFoundError, ProcessLookupError):  # gone after the listing; ESRCH if gone while read
            continue
    return texts


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (rank followers of an instance, ...), from /proc."""
    found = []
    for children in task_files(pid, "children"):
        for child in map(int, children.split()):
            found += [child, *descendants(child)]
    return found


def listening(pids: list[int]) -> set[str]:
    """The addresses (ip:port) the processes `pids` accept TCP connections on (IPv4 in IPv6 as IPv4)."""
    def ip(text: str) -> str:
        address = ipaddress.ip_address(text)
        return str(getattr(address, "ipv4_mapped", None) or address)

    return {f"{ip(c.laddr.ip)}:{c.laddr.port}" for pid in pids for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}
