"""`infermesh up` for a benchmark: started with the given flags, its router address yielded once every
instance serves, stopped (Ctrl-C, as a user would) when the block ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def running_mesh(*flags: str) -> Iterator[str]:
    up = subprocess.Popen([str(Path(sys.executable).parent / "infermesh"), "up", "--port", "0", *flags],
                          stdout=subprocess.PIPE, text=True)
    try:
        address = next(line.split()[3] for line in up.stdout if line.startswith("infermesh ready on "))
        threading.Thread(target=up.stdout.read, daemon=True).start()  # keep its pipe drained
        yield address
    finally:
        up.send_signal(2)
        up.wait(timeout=60)
