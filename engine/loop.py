"""Drive an `EngineCore` from one thread while other threads submit work: the serving loop of an instance.

The loop thread owns the engine. It runs queued commands (`call(fn)` runs `fn`
there between steps and returns its result or raises its exception in the
caller's thread), then one engine step, handing every output to `on_output`; it
sleeps on the command queue while the engine has nothing to do. `stop()` ends
the loop, aborts what is unfinished (each abort is reported through
`on_stop(request_id)`), and is safe to call twice.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

from engine.core import EngineCore, StepOutput


class EngineLoop:
    def __init__(self, engine: EngineCore, on_output: Callable[[StepOutput], None], name: str = "engine") -> None:
        self.engine, self.on_output = engine, on_output
        self._commands: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def call(self, fn: Callable):
        """Run `fn()` on the loop thread between steps; its result, or its exception raised here."""
        if self._stopped.is_set():
            raise RuntimeError("the engine loop has stopped")
        done: Future = Future()
        self._commands.put((fn, done))
        return done.result()

    def stop(self, on_stop: Callable[[], None] | None = None) -> None:
        """End the loop; `on_stop` runs on the loop thread last (to abort what is left)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._commands.put((on_stop or (lambda: None), Future()))
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            try:
                item = self._commands.get(timeout=0 if self.engine.has_unfinished() else None)
            except queue.Empty:
                item = False
            while item:
                fn, done = item
                try:
                    done.set_result(fn())
                except Exception as e:  # reported to the caller; the loop goes on
                    done.set_exception(e)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = False
            if item is None:
                return
            if self.engine.has_unfinished():
                for out in self.engine.step():
                    self.on_output(out)
