"""Drive an `EngineCore` from one thread while other threads submit work: the serving loop of an instance.

The loop thread owns the engine. It runs queued commands (`call(fn)` runs `fn`
there between steps and returns its result or raises its exception in the
caller's thread), then one engine step, handing every output to `on_output`; it
sleeps on the command queue while the engine has nothing to do. `stop()` ends
the loop, runs `on_stop` there last (to abort what is unfinished), and is safe
to call twice. If a step raises, the loop stops: `on_failure(error)` runs (to
fail the requests waiting on it) and every later `call` raises.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

from engine.core import EngineCore, StepOutput


class EngineLoop:
    def __init__(self, engine: EngineCore, on_output: Callable[[StepOutput], None], name: str = "engine",
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine, self.on_output, self.on_failure = engine, on_output, on_failure
        self.error: BaseException | None = None
        self._commands: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def call(self, fn: Callable):
        """Run `fn()` on the loop thread between steps; its result, or its exception raised here."""
        if self._stopped.is_set():
            raise RuntimeError(f"the engine loop has stopped{f': {self.error!r}' if self.error else ''}")
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
                try:
                    outputs = self.engine.step()
                except Exception as e:
                    self._fail(e)
                    return
                for out in outputs:
                    self.on_output(out)

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._stopped.set()
        if self.on_failure is not None:
            self.on_failure(error)
        while True:  # commands queued meanwhile get the error too
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item:
                item[1].set_exception(RuntimeError(f"the engine loop has stopped: {error!r}"))
