"""Drive an `EngineCore` from one thread while other threads submit work: the serving loop of an instance.

The loop thread owns the engine. It runs queued commands (`call(fn)` runs `fn`
there between steps and returns its result or raises its exception in the
caller's thread; `submit(fn)` returns its future instead), then one engine step,
handing its outputs to `on_outputs` (all of them in one call); it sleeps on the
command queue while the engine has nothing to do. `stop()` ends the loop, runs
`on_stop` there last (to abort what is unfinished), and is safe to call twice. If
a step raises, the loop stops: `on_failure(error)` runs (to fail the requests
waiting on it) and every later `call` raises `PeerFailed`; after `stop()` it
raises `Draining`.

With `cpus` (engine.cpu_lending) the loop holds this process's cores while the engine has work and lets
go of them while it waits; before each step it borrows the idle cores it may and runs the step on that many
more intra-op threads, giving them back after it.

`start()` runs the loop on a thread of its own; `run_here()` then moves it into the
calling thread, between two steps, and returns when it stops. A serving process
moves it into its main thread: on CPU, torch's intra-op threads (OpenMP, MKL)
run matmuls 2-4x slower for any other thread.

A test holds an instance at a known point with `INFERMESH_TEST_HOLD_FILE=PATH` in its environment: while
that file exists the loop runs commands (work arrives, cancels and reservations are served) but no step.
Unset, it costs nothing.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from engine.core import EngineCore, StepOutput
from engine.cpu_lending import CpuLending
from engine.errors import Draining, PeerFailed

_MOVE = "move"  # a command: the loop's thread lets go of it (`run_here`)
HOLD_POLL_S = 0.01  # how often a held loop looks at its hold file


class EngineLoop:
    def __init__(self, engine: EngineCore, on_outputs: Callable[[list[StepOutput]], None], name: str = "engine",
                 on_failure: Callable[[BaseException], None] | None = None, cpus: CpuLending | None = None) -> None:
        self.engine, self.on_outputs, self.on_failure, self.cpus = engine, on_outputs, on_failure, cpus
        self.error: BaseException | None = None
        self.borrowed_steps = 0  # steps run on borrowed cores too
        self._commands: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._finished = threading.Event()  # the loop has returned for good (stopped or failed)
        self._runner: threading.Thread | None = None  # the thread the loop runs on
        self.threads = torch.get_num_threads()  # the creating thread's intra-op threads: the loop's, wherever it runs
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._hold_file = os.environ.get("INFERMESH_TEST_HOLD_FILE")

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def run_here(self) -> None:
        """Take the started loop into the calling thread (after the step in hand) and run it until it stops."""
        self._commands.put(_MOVE)
        self._thread.join()
        if not self._finished.is_set():
            self._run()

    def call(self, fn: Callable):
        """Run `fn()` on the loop thread between steps; its result, or its exception raised here."""
        return self.submit(fn).result()

    def submit(self, fn: Callable) -> Future:
        """Queue `fn()` to run on the loop thread between steps; its future."""
        if self._stopped.is_set():
            raise self._stopped_error()
        done: Future = Future()
        self._commands.put((fn, done))
        return done

    def stop(self, on_stop: Callable[[], None] | None = None) -> None:
        """End the loop; `on_stop` runs on the loop thread last (to abort what is left)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._commands.put((on_stop or (lambda: None), Future()))
        self._commands.put(None)
        if self._runner not in (None, threading.current_thread()):
            self._finished.wait(timeout=30)  # on whichever thread runs it

    def _run(self) -> None:
        self._runner = threading.current_thread()
        torch.set_num_threads(self.threads)  # a new thread would take the count last set anywhere (engine.threads)
        moved = False
        try:
            moved = self._loop() is _MOVE
        finally:
            if not moved:
                if self.cpus is not None:
                    self.cpus.close()  # no core of this process's is held once the loop is done
                self._finished.set()

    def _loop(self):
        while True:
            held = self._held()
            busy = self.engine.has_unfinished() and not held
            if not busy and self.cpus is not None:
                self.cpus.idle()
            try:
                item = self._commands.get(timeout=0 if busy else HOLD_POLL_S if held else None)
            except queue.Empty:
                item = False
            while item:
                if item is _MOVE:
                    return _MOVE
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
                return None
            if self.engine.has_unfinished() and not self._held():  # (asked again: a wait may have been long)
                try:
                    outputs = self._step()
                except Exception as e:
                    self._fail(e)
                    return None
                self.on_outputs(outputs)

    def _held(self) -> bool:
        return self._hold_file is not None and os.path.exists(self._hold_file)

    def _step(self) -> list[StepOutput]:
        if self.cpus is None:
            return self.engine.step()
        self.cpus.work()
        borrowed = self.cpus.borrow()
        if borrowed:  # this thread, and the team it starts, on the borrowed cores too
            self.borrowed_steps += 1
            os.sched_setaffinity(0, self.cpus.own + borrowed)
            torch.set_num_threads(self.threads + len(borrowed))
        try:
            return self.engine.step()
        finally:
            if borrowed:  # off them before they are given back: their owner may be waiting
                torch.set_num_threads(self.threads)
                os.sched_setaffinity(0, self.cpus.own)
            self.cpus.give_back()

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
            if item and item is not _MOVE:
                item[1].set_exception(self._stopped_error())

    def _stopped_error(self) -> Exception:
        if self.error is not None:
            return PeerFailed(f"the engine failed: {self.error!r}")
        return Draining("the engine has stopped")
