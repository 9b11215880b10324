"""The driver drops the traceback a Ray worker prints when Ray's SIGTERM handler fires inside a weakref callback (its
teardown, after the sweep's last progress line) and forwards everything else a worker prints, in order."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from sweeps_common import REPO

from ablate.sweep.worker_output import TeardownFilter

_SIGTERM_TRACEBACK = [
    "Exception ignored in: <function WeakSet.__init__.<locals>._remove at 0x7f4be0f7a660>",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/_weakrefset.py", line 39, in _remove',
    "    def _remove(item, selfref=ref(self)):",
    "",
    '  File "/venv/lib/python3.11/site-packages/ray/_private/worker.py", line 1063, in sigterm_handler',
    "    raise_sys_exit_with_custom_error_message(",
    '  File "python/ray/_raylet.pyx", line 712, in ray._raylet.raise_sys_exit_with_custom_error_message',
    "SystemExit: 1",
]
_TRIAL_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/repo/trainers/run.py", line 10, in run_arm',
    "    raise ValueError('bad arm')",
    "ValueError: bad arm",
    "",
    "During handling of the above exception, another exception occurred:",
    "",
    "Traceback (most recent call last):",
    '  File "/repo/trainers/run.py", line 12, in run_arm',
    "SystemExit: 1",
]


def _batch(lines, pid=7, is_err=True):
    return {"ip": "10.0.0.1", "pid": pid, "job": "01000000", "is_err": is_err, "lines": list(lines),
            "actor_name": "", "task_name": "run_block"}


def _filtered(*batches):
    seen: list[dict] = []
    filt = TeardownFilter(seen.append)
    for batch in batches:
        filt(batch)
    return filt, [(b["pid"], line) for b in seen for line in b["lines"]]


def test_the_sigterm_traceback_is_dropped_and_the_lines_around_it_are_kept_in_order():
    filt, out = _filtered(_batch(["before"] + _SIGTERM_TRACEBACK + ["after"]))
    assert out == [(7, "before"), (7, "after")]
    assert filt.dropped == 1


def test_a_sigterm_traceback_split_over_batches_is_dropped_while_other_workers_print_between():
    filt, out = _filtered(_batch(["first"] + _SIGTERM_TRACEBACK[:5]), _batch(["other worker"], pid=8),
                          _batch(_SIGTERM_TRACEBACK[5:] + ["last"]))
    assert out == [(7, "first"), (8, "other worker"), (7, "last")]
    assert filt.dropped == 1 and filt.held == {}


def test_any_other_traceback_reaches_the_console_whole_even_one_ending_in_systemexit():
    # A trial's own error (and an exception chained onto it) is the user's business; only Ray's handler frame marks
    # the teardown.
    filt, out = _filtered(_batch(_TRIAL_TRACEBACK[:2]), _batch(_TRIAL_TRACEBACK[2:] + ["next"]))
    assert [line for _, line in out] == _TRIAL_TRACEBACK + ["next"]
    assert filt.dropped == 0 and filt.held == {}


def test_stdout_and_stderr_of_one_worker_are_held_apart():
    filt, out = _filtered(_batch(_SIGTERM_TRACEBACK[:3]), _batch(["progress on stdout"], is_err=False),
                          _batch(_SIGTERM_TRACEBACK[3:]))
    assert out == [(7, "progress on stdout")]
    assert filt.dropped == 1


def test_a_real_worker_killed_inside_a_weakref_callback_prints_nothing_on_the_driver(tmp_path):
    # What fresh-clone CI saw after a sweep's last progress line, made to happen on purpose: Ray's SIGTERM handler
    # raises inside a weakref callback, so Python prints "Exception ignored ... SystemExit: 1" and Ray forwards it.
    driver = textwrap.dedent("""
        import os, signal, sys, time, traceback, weakref
        import ray
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        from ablate.sweep.run import ensure_ray

        assert ensure_ray()

        @ray.remote(num_cpus=0)
        def torn_down():
            class Thing: pass
            def on_collect(_ref):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # Python runs the signal handler here, inside the callback
            thing = Thing()
            ref = weakref.ref(thing, on_collect)
            del thing
            try:
                raise ValueError("a trial's own error")
            except ValueError:
                traceback.print_exc()
            print("worker done", flush=True)

        ray.get(torn_down.remote())
        deadline = time.monotonic() + 30
        [filt] = [handler for name, handler in dispatcher.handlers if name == "ray_print_logs"]
        while time.monotonic() < deadline and filt.dropped == 0:
            time.sleep(0.2)
        time.sleep(1)
        print("dropped", filt.dropped, flush=True)
        ray.shutdown()
    """)
    out = subprocess.run([sys.executable, "-c", driver], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dropped 1" in out.stdout, (out.stdout, out.stderr[-3000:])
    assert "worker done" in out.stdout
    assert "SystemExit" not in out.stderr and "sigterm_handler" not in out.stderr, out.stderr[-3000:]
    assert "ValueError: a trial's own error" in out.stderr and "in torn_down" in out.stderr, out.stderr[-3000:]


def test_a_traceback_a_worker_never_finished_is_passed_on_by_flush_under_its_own_task():
    first = _batch(["ok"] + _TRIAL_TRACEBACK[:2]) | {"task_name": "task_a"}
    later = _batch(["  File \"x.py\", line 3, in g"]) | {"task_name": "task_b"}
    seen: list[dict] = []
    filt = TeardownFilter(seen.append)
    filt(first)
    filt(later)
    assert [(b["task_name"], b["lines"]) for b in seen] == [("task_a", ["ok"])]  # still held: it may go on
    filt.flush()
    assert [(b["task_name"], b["lines"]) for b in seen][1:] == [
        ("task_a", _TRIAL_TRACEBACK[:2] + ["  File \"x.py\", line 3, in g"])]
    assert filt.held == {}
    # Cut short inside Ray's SIGTERM handler: the teardown one, dropped at the flush too.
    cut = TeardownFilter(seen.append)
    cut(_batch(_SIGTERM_TRACEBACK[:7]))
    cut.flush()
    assert cut.dropped == 1 and len(seen) == 2
