"""One process's staging area in /dev/shm for the `shared_memory` transport: a single file, mapped once,
whose regions pushes borrow and give back, so the pages a push writes are already there (a fresh tmpfs
page costs a fault on first touch: writing 64 MB into new pages takes ~5x as long as into mapped ones).

    region = arena().take(nbytes)      # fresh pages are reserved with posix_fallocate: a full /dev/shm
    region.tensor                      #   is an OSError here, never a SIGBUS later
    arena().give_back(region)          # the push was acknowledged: the region serves the next one
    arena().discard(region)            # the push failed: its pages go back to the host, its bytes are not
                                       #   handed out for QUARANTINE_S (a late reader sees zeros, not another push)

A prefill instance may hold its KV cache here too (`shared_zeros`): decode then copies a push straight out
of it, one copy in all.

The file is sparse (`VIRTUAL_BYTES`, only what was taken holds memory) and named `PREFIX<pid>-...`; it is
unlinked when the process exits, and `sweep` (run by each sender and each shared cache as they start on the
host) removes one whose process was killed. Regions come in size classes (four per doubling, whole pages),
each with a free list; freed regions beyond `POOL_BYTES` of idle memory give their pages back (and are
reserved again when reused), so the file's offsets stay bounded by the pushes in flight. Thread-safe; a
forked child makes its own arena.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import math
import mmap
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
PREFIX = "infermesh-kv-"
VIRTUAL_BYTES = 1 << 38  # address space only (256 GiB): tmpfs allocates a page when it is reserved or written
POOL_BYTES = 1 << 30  # idle regions kept ready up to this; the rest give their pages back
QUARANTINE_S = 600.0  # a failed push's region is not handed out again before every reader's deadline is past
PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class Region:
    offset: int
    size: int  # its size class, >= what was asked
    tensor: torch.Tensor  # [size] uint8 over the mapping


def size_class(nbytes: int) -> int:
    """The smallest of whole pages x {4, 5, 6, 7} x 2^k holding `nbytes` (at most 25 % more)."""
    pages = max(1, -(-nbytes // PAGE))
    if pages <= 4:
        return pages * PAGE
    shift = pages.bit_length() - 3  # pages in [4, 8) << shift
    return (-(-pages // (1 << shift)) << shift) * PAGE


class Arena:
    def __init__(self) -> None:
        self.pid = os.getpid()
        fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{self.pid}-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, VIRTUAL_BYTES)
            self._map = mmap.mmap(fd, VIRTUAL_BYTES)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        with torch.inference_mode(False):  # a normal tensor, written inside and outside the engine's step
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # [VIRTUAL_BYTES], no copy
        self.base = self._bytes.data_ptr()
        self._free: dict[int, list[int]] = {}  # size class -> offsets of idle regions with their pages
        self._cold: dict[int, list[tuple[float, int]]] = {}  # size class -> (reusable from, offset), pages freed
        self._end = 0  # bytes ever handed out: regions lie below it
        self.idle_bytes = self.taken_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Region:
        size = size_class(nbytes)
        with self._lock:
            if self._free.get(size):
                offset = self._free[size].pop()
                self.idle_bytes -= size
            else:
                reused = offset = self._reusable(size)
                if offset is None:
                    offset = self._end
                    if offset + size > VIRTUAL_BYTES:
                        raise OSError(errno.ENOSPC, f"No space left in the staging file's {VIRTUAL_BYTES} bytes")
                try:
                    os.posix_fallocate(self._fd, offset, size)  # OSError (ENOSPC) when /dev/shm is full
                except OSError:
                    if reused is not None:  # still free, pages and all gone: it serves a later take
                        self._cold[size].append((0.0, reused))
                    raise
                self._end = max(self._end, offset + size)
            self.taken_bytes += size
        return Region(offset, size, self._bytes[offset:offset + size])

    def _reusable(self, size: int) -> int | None:
        """A region of this class whose pages were freed and whose quarantine is over, taken off the list."""
        cold, now = self._cold.get(size, []), time.monotonic()
        for i, (reusable_from, offset) in enumerate(cold):
            if reusable_from <= now:
                del cold[i]
                return offset
        return None

    def give_back(self, region: Region) -> None:
        with self._lock:
            self.taken_bytes -= region.size
            if self.idle_bytes + region.size > POOL_BYTES:
                self._release(region, 0.0)
                return
            self._free.setdefault(region.size, []).append(region.offset)
            self.idle_bytes += region.size

    def discard(self, region: Region) -> None:
        with self._lock:
            self.taken_bytes -= region.size
            self._release(region, QUARANTINE_S)

    def _release(self, region: Region, quarantine_s: float) -> None:
        """Give the region's pages back to the host; its offsets serve again `quarantine_s` from now."""
        self._map.madvise(mmap.MADV_REMOVE, region.offset, region.size)
        self._cold.setdefault(region.size, []).append((time.monotonic() + quarantine_s, region.offset))

    def owns(self, tensor: torch.Tensor) -> int | None:
        """The offset of a host tensor that lies in this arena's mapping, else None."""
        if tensor.device.type != "cpu":
            return None
        offset = tensor.data_ptr() - self.base
        return offset if 0 <= offset < self._end else None

    def close(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child's copy: the file is its parent's
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)


def sweep() -> list[str]:
    """Remove the files of senders that are gone (killed before they could unlink them); what was removed."""
    removed = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(PREFIX) and not alive(owner_pid(name)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed


def owner_pid(path: str) -> int | None:
    """The process a staging file (`PREFIX<pid>-...`) belongs to."""
    pid = os.path.basename(path).removeprefix(PREFIX).split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def alive(pid: int | None) -> bool:
    if pid is None:
        return True  # not a name we give: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def shared_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor held in this process's arena for the process's life (a KV cache that the
    `shared_memory` transport's readers copy from in place); a full /dev/shm is an OSError naming it."""
    nbytes = math.prod(shape) * dtype.itemsize
    sweep()  # a killed process's cache is gone from the host before this one takes its share
    try:
        region = arena().take(nbytes)  # fresh tmpfs pages read as zeros
    except OSError as e:
        raise OSError(e.errno, f"cannot hold {nbytes} bytes of KV cache in {SHM_DIR}: {e.strerror} (a larger "
                               f"{SHM_DIR}, a smaller --kv-cache-bytes, or a --kv-transport other than shared_memory)"
                      ) from None
    return region.tensor[:nbytes].view(dtype).view(shape)


_arena: Arena | None = None
_arena_lock = threading.Lock()


def arena() -> Arena:
    """This process's arena, made on first use."""
    global _arena
    with _arena_lock:
        if _arena is None or _arena.pid != os.getpid():
            _arena = Arena()
            atexit.register(_arena.close)
        return _arena
