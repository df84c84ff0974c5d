"""hcstudy/progress.py: the pace while a run trains: status.json's live fields, the ETA's moving average, and a
plain log line every --log-every steps where no terminal shows a bar."""
from types import SimpleNamespace

import pytest

from hcstudy.progress import Progress


class Log:
    """What Progress asks of run_folder.RunLog: its live fields, its lines and its status."""

    def __init__(self):
        self.live, self.lines, self.states, self.bar = {}, [], [], None

    def info(self, message, terminal=True):
        self.lines.append((message, terminal))

    def status(self, state, step):
        self.states.append((state, step))


def record(step, seconds, **extra):
    return {"step": step, "step_time_s": seconds, "loss": 3.0, "lr": 1e-3, "grad_norm": 0.5, "tokens": 100 * step,
            "tokens_per_s": 1234.0, **extra}


def test_live_fields_and_an_eta_that_follows_the_recent_pace_not_the_first_step():
    log = Log()
    progress = Progress(SimpleNamespace(steps=10, log_every=5), is_main=False, log=log, step=0)
    assert log.live["steps"] == 10 and progress.bar is None              # not a terminal: log lines
    progress.update(record(1, 10.0))                                       # the first step compiles
    assert log.live["eta_s"] == pytest.approx(10.0 * 9)
    progress.update(record(2, 1.0, amax_fwd=2.5))
    assert log.live["eta_s"] == pytest.approx((0.9 * 10.0 + 0.1 * 1.0) * 8)
    assert log.live["loss"] == 3.0 and log.live["amax_fwd"] == 2.5 and "step" not in log.live
    assert log.lines == [] and log.states == []                            # not a log step yet


def test_a_line_every_log_every_steps_and_at_the_last_step():
    log = Log()
    progress = Progress(SimpleNamespace(steps=7, log_every=5), is_main=False, log=log, step=0)
    for step in range(1, 8):
        progress.update(record(step, 1.0, **({"val_loss": 2.75} if step == 7 else {})))
    assert [state for state in log.states] == [("running", 5), ("running", 7)]
    (five, terminal), (seven, _) = log.lines
    assert terminal and five.startswith("step 5/7 loss 3.0000 lr 0.001 grad_norm 0.5 amax_fwd - tok/s 1,234")
    assert five.endswith("eta 0:00:02") and " val 2.7500 " in seven and seven.endswith("eta 0:00:00")
    progress.close()
