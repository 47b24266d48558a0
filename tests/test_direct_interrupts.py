"""Direct mode under signals that land anywhere in `log()` (issue 52 item 5, attacked).

A KeyboardInterrupt (Ctrl-C, or a handler that raises) can be raised between any two
bytecodes of the training thread, also inside the tracker's `log()` and `flush()`. A lock
taken there and not released would hold every later `log()`, `finish()` and the exit
path for good. The child here raises KeyboardInterrupt from a real SIGALRM every 50 us
while it is inside the tracker's code: within a few seconds that lands between every two
bytecodes of the hot path. It then finishes; the test checks it exits, and that the shard holds every step
of every log() that returned, once, in order, finished.
"""

from __future__ import annotations

import json
import subprocess

from .procs import spawn

CHILD = """
import faulthandler, json, signal, sys, time
import expr_tracker as et

run = et.init("p", "r", dir=sys.argv[1] if len(sys.argv) > 1 else {root!r})
row = {{f"k{{j}}": 1.0 for j in range(20)}}

def interrupt(signum, frame):
    # only inside the tracker: the loop below must stay able to count them
    if frame is not None and "expr_tracker" in frame.f_code.co_filename:
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
hits, returned, end = 0, 0, time.monotonic() + {seconds!r}

def loop():
    global returned
    while time.monotonic() < end:
        et.log(row)
        returned += 1
        if returned % 500 == 0:
            et.flush()

signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00005)
while True:
    try:
        loop()
        break
    except KeyboardInterrupt:
        hits += 1
signal.setitimer(signal.ITIMER_REAL, 0, 0)
signal.signal(signal.SIGALRM, signal.SIG_IGN)  # an alarm still pending
faulthandler.dump_traceback_later(20, exit=True)  # where it hangs, if it does
et.finish()
print(json.dumps({{"hits": hits, "returned": returned}}), flush=True)
"""


def _rows(path):
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_keyboard_interrupts_anywhere_in_log_never_hold_finish(tmp_path):
    root = tmp_path / "runs"
    proc = spawn(CHILD.format(root=str(root), seconds=4.0))
    try:
        out, err = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the child hangs after interrupts in log(): {err[-2000:]}") from None
    assert proc.returncode == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["hits"] > 100, res  # interrupts landed in the loop
    rows = _rows(root / "p" / "r" / "metrics.jsonl")
    steps = [r["_step"] for r in rows if "_kind" not in r]
    # every log() that returned is there (one that was interrupted may be, or leave a
    # step unused), once, in order
    assert len(steps) >= res["returned"] > 0, (len(steps), res)
    assert steps == sorted(set(steps))
    side = json.loads((root / "p" / "r" / "metrics.meta.json").read_bytes())
    assert side["status"] == "finished"


EXIT_CHILD = """
import signal, sys
import expr_tracker as et

run = et.init("p", "r", dir={root!r})
for i in range(20000):
    et.log({{"x": float(i)}})

def interrupt(signum, frame):
    # the second Ctrl-C, once, inside finish() (in the tracker, or what it calls)
    while frame is not None and "expr_tracker" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is not None:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
# no finish(): the interpreter's exit finishes the run
"""


def test_an_interrupt_during_the_exit_finish_still_closes_the_shard(tmp_path):
    """Ctrl-C pressed again while the exit path finishes the run (it may wait on the
    root or a backend): the shard still ends with every row and a final status, within
    about a second, not `running` with the queued rows lost."""
    root = tmp_path / "runs"
    proc = spawn(EXIT_CHILD.format(root=str(root)))
    _, err = proc.communicate(timeout=40)
    rows = _rows(root / "p" / "r" / "metrics.jsonl")
    steps = [r["_step"] for r in rows if "_kind" not in r]
    side = json.loads((root / "p" / "r" / "metrics.meta.json").read_bytes())
    assert side["status"] == "finished", (side["status"], err[-2000:])
    assert steps == list(range(20000)), len(steps)


def test_an_interrupt_during_an_explicit_finish_still_closes_the_shard(tmp_path):
    """The same Ctrl-C during the script's own `et.finish()`: it reaches the script, and
    the shard is closed all the same (the exit path has nothing left to finish)."""
    root = tmp_path / "runs"
    code = EXIT_CHILD.format(root=str(root)).replace(
        "# no finish(): the interpreter's exit finishes the run",
        "try:\n    et.finish()\nexcept KeyboardInterrupt:\n    print('interrupted', flush=True)")
    proc = spawn(code)
    out, err = proc.communicate(timeout=40)
    assert "interrupted" in out, err[-2000:]
    rows = _rows(root / "p" / "r" / "metrics.jsonl")
    steps = [r["_step"] for r in rows if "_kind" not in r]
    side = json.loads((root / "p" / "r" / "metrics.meta.json").read_bytes())
    assert side["status"] == "finished", (side["status"], err[-2000:])
    assert steps == list(range(20000)), len(steps)
