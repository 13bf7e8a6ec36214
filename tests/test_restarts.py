"""What `infermesh up` does with a process that exits: the restart policy (mesh.restarts, pure) and the
children that follow it (mesh.children, real processes: `python -c` that crash, hang or exit 0)."""

from __future__ import annotations

import sys

import pytest

from mesh.children import Children, ProcessState
from mesh.restarts import RestartPolicy, decide
from tests.helpers import assert_exited, wait_until

POLICY = RestartPolicy(max_restarts=3, window_s=100.0, first_backoff_s=1.0, max_backoff_s=3.0)


def test_the_back_off_doubles_with_each_recent_restart_up_to_its_cap():
    assert [decide(POLICY, 1, tuple(range(n)), now=10.0).delay_s for n in range(3)] == [1.0, 2.0, 3.0]


def test_past_the_limit_within_the_window_a_process_is_left_down_saying_why():
    restart = decide(POLICY, -9, (1.0, 2.0, 3.0), now=10.0)
    assert restart.delay_s is None
    assert restart.reason == "was killed by signal 9; left down after 3 restarts in 100 s (--max-restarts 3)"


def test_restarts_older_than_the_window_no_longer_count():
    restart = decide(POLICY, 1, (1.0, 2.0, 150.0), now=160.0)  # two of three are over 100 s old
    assert restart.delay_s == 2.0 and restart.reason == "exited with code 1; restart 2 of 3 in 100 s, in 2 s"


def test_zero_restarts_means_never_restart():
    assert decide(RestartPolicy(max_restarts=0), 1, (), now=0.0).delay_s is None


@pytest.mark.parametrize("bad,named", [(dict(max_restarts=-1), "max_restarts"),
                                       (dict(first_backoff_s=0.0), "first_backoff_s"),
                                       (dict(first_backoff_s=5.0, max_backoff_s=1.0), "max_backoff_s"),
                                       (dict(window_s=0.0), "window_s")])
def test_a_bad_policy_is_refused_naming_the_setting(bad, named):
    with pytest.raises(ValueError, match=named):
        RestartPolicy(**bad)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def watch_until(children: Children, condition, events: list[str]) -> None:
    def done():
        events.extend(children.watch())
        return condition()
    wait_until(done)


def test_a_crashed_child_runs_again_with_its_argv_and_is_counted(tmp_path):
    counted = []
    children = Children(RestartPolicy(first_backoff_s=0.05), on_restart=counted.append)
    marker = tmp_path / "started"
    # crashes the first time it runs, then stays up
    child = children.run("decode-0", "decode", python(
        f"import pathlib, sys, time; p = pathlib.Path({str(marker)!r}); first = not p.exists(); p.touch(); "
        "print('up', flush=True); sys.exit(3) if first else time.sleep(600)"), {}, tmp_path / "decode-0.log")
    first_pid, events = child.process.pid, []
    try:
        watch_until(children, lambda: len(child.restarted_at) == 1, events)
        assert child.state is ProcessState.RUNNING and child.process.pid != first_pid and child.last_exit == 3
        assert counted == [child]
        assert events[0] == (f"decode-0 exited with code 3; restart 1 of 5 in 600 s, in 0.05 s "
                             f"(log: {tmp_path / 'decode-0.log'})")
        assert events[1] == f"decode-0 restarted (pid {child.process.pid})"
        wait_until(lambda: child.log.read_text().count("up\n") == 2)  # both runs' output, the restart between
        assert child.log.read_text().startswith("up\n--- restarted by infermesh up: exited with code 3")
    finally:
        children.stop(grace_s=5)
    assert_exited([child.process.pid])


def test_a_child_that_crashes_at_every_start_is_left_down_after_the_limit(tmp_path):
    children = Children(RestartPolicy(max_restarts=2, first_backoff_s=0.01))
    child = children.run("prefill-0", "prefill", python("raise SystemExit('no model here')"), {},
                         tmp_path / "prefill-0.log")
    events: list[str] = []
    watch_until(children, lambda: child.state is ProcessState.DOWN, events)
    assert len(child.restarted_at) == 2 and child.last_exit == 1
    assert child.reason == "exited with code 1; left down after 2 restarts in 600 s (--max-restarts 2)"
    assert children.alive("prefill") == [] and children.all() == [child]  # kept, for status to show
    assert "no model here" in child.tail()


def test_a_child_waiting_to_restart_can_be_retired_and_a_running_one_cannot(tmp_path):
    children = Children(RestartPolicy(first_backoff_s=60.0, max_backoff_s=60.0))
    waiting = children.run("decode-1", "decode", python("raise SystemExit(1)"), {}, tmp_path / "decode-1.log")
    running = children.run("decode-0", "decode", python("import time; time.sleep(600)"), {}, tmp_path / "d0.log")
    try:
        watch_until(children, lambda: waiting.state is ProcessState.RESTARTING, [])
        assert children.alive("decode") == [waiting, running]  # both count: one is back after its back-off
        assert children.retire(waiting) and not children.retire(running)
        assert children.all() == [running]
    finally:
        children.stop(grace_s=5)


def test_a_clean_exit_is_let_go_and_never_restarted(tmp_path):
    children = Children(RestartPolicy(first_backoff_s=0.01))
    child = children.run("decode-1", "decode", python("pass"), {}, tmp_path / "decode-1.log")
    events: list[str] = []
    watch_until(children, lambda: not children.all(), events)
    assert events == ["decode-1 drained and left"] and child.restarted_at == []


def test_stop_ends_every_child_and_cancels_pending_restarts(tmp_path):
    children = Children(RestartPolicy(first_backoff_s=60.0, max_backoff_s=60.0))
    hanging = children.run("router", "router", python("import signal, time; signal.signal(signal.SIGTERM, "
                                                      "signal.SIG_IGN); print('up', flush=True); time.sleep(600)"),
                           {}, tmp_path / "router.log")
    crashed = children.run("registry", "registry", python("raise SystemExit(2)"), {}, tmp_path / "registry.log")
    wait_until(lambda: hanging.log.read_text() == "up\n")  # its SIGTERM handler is in place
    watch_until(children, lambda: crashed.state is ProcessState.RESTARTING, [])
    children.stop(grace_s=0.5)  # the one that ignores SIGTERM is killed
    assert hanging.process.returncode == -9 and crashed.state is ProcessState.DOWN
    assert children.watch() == [] and crashed.restarted_at == []
