"""The launcher's live view of a matrix (report.py --watch, run_experiments.sh --summary), from matrix.log and each
run's status.json."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from hcstudy.contract import JOB_STATES, MATRIX_LOG, STATUS_FILE, log_time, open_regular, read_json, read_log_line
from hcstudy.durations import clock
from hcstudy.report.runs import STALE_AFTER_MIN, ReportError, _num, stopped_state, warn
from hcstudy.report.tables import fmt_gain, fmt_loss


@dataclass
class MatrixLog:
    """The launcher's last invocation in a runs folder, as matrix.log tells it."""
    started: float
    slots: int
    gpus_per_run: int
    price: float
    cpu: bool
    runs: dict                   # run -> [state, gpus]: in queue order
    planned: dict = field(default_factory=dict)     # run -> the trainer's planned seconds, before steps are timed
    ended: float | None = None   # when the invocation ended (its END line): the elapsed clock stops there
    launched: dict = field(default_factory=dict)    # run -> when its last LAUNCH line was written


def read_matrix(root, log=MATRIX_LOG):
    """The last invocation's QUEUE line and every job event after it; None without one."""
    try:
        with open_regular(root / log) as f:
            lines = [read_log_line(line) for line in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if line and line.event == "QUEUE"]
    if not starts:
        return None
    queue = lines[starts[-1]]
    runs = {name: ["queued", ""] for name in queue.fields.get("runs", "").split(",") if name}
    ended, launched = None, {}
    for line in lines[starts[-1] + 1:]:
        if line and line.event in JOB_STATES and line.run in runs:
            runs[line.run] = [JOB_STATES[line.event], line.fields.get("gpus", runs[line.run][1])]
            launched |= {line.run: line.stamp} if line.event == "LAUNCH" else {}
        ended = line.stamp if line and line.event == "END" else ended
    try:
        fields = queue.fields
        planned = {name: float(s) for name, s in (item.split(":") for item in fields.get("planned_s", "").split(",")
                                                   if item.count(":") == 1)}
        return MatrixLog(log_time(queue.stamp), int(fields.get("slots", 1)), int(fields.get("gpus_per_run", 1)),
                         float(fields.get("price_per_gpu_hour", 0)), fields.get("gpus") == "cpu", runs, planned,
                         ended and log_time(ended), {run: log_time(stamp) for run, stamp in launched.items()})
    except ValueError as e:
        warn(f"{root / log}: its last QUEUE line is unreadable ({e}); the matrix's progress is left out")
        return None


def job_seconds(status):
    """A whole run's time at its latest pace (steps x step time), NaN when not known yet."""
    steps, step_time = status.get("steps"), status.get("step_time_s")
    return steps * step_time if isinstance(steps, int) and isinstance(step_time, (int, float)) else math.nan


def wall_eta(matrix, statuses):
    """Seconds until the queue is empty: running jobs hold their slots for their ETA, queued ones start in order
    on the first free slot and take the time of runs of the same method and depth at their pace. Until such steps
    are timed a job takes the trainer's planned time (its plan knows an HC step from a baseline one), and only
    without one the time of any run."""
    def kind(name):
        return name.split("_s")[0]
    durations = {}
    for name, status in statuses.items():
        if math.isfinite(job_seconds(status)):
            durations.setdefault(kind(name), []).append(job_seconds(status))
    anything = [d for ds in durations.values() for d in ds]
    free = sorted(statuses[name].get("eta_s") or matrix.planned.get(name) or 0.0
                  for name, (state, _) in matrix.runs.items() if state == "running")
    free += [0.0] * max(0, matrix.slots - len(free))
    for name, (state, _) in matrix.runs.items():
        if state == "queued":
            guess = durations.get(kind(name)) or ([matrix.planned[name]] if name in matrix.planned else anything)
            if not guess:
                return math.nan
            free[0] += sum(guess) / len(guess)
            free.sort()
    return max(free, default=0.0)


def read_matrices(root, log=None):
    """One launcher's matrix (`log`), else the folder's: matrix.log, or the nodes' shares (matrix.node{i}.log,
    run_experiments.sh --nodes) as one matrix: their slots added up, their queues one after another."""
    names = [log] if log else [MATRIX_LOG] if (root / MATRIX_LOG).exists() else \
        sorted(p.name for p in root.glob("matrix.node*.log"))
    shares = [m for m in (read_matrix(root, name) for name in names) if m is not None]
    if not shares:
        return None
    ends = [m.ended for m in shares]
    return MatrixLog(min(m.started for m in shares), sum(m.slots for m in shares), shares[0].gpus_per_run,
                  shares[0].price, all(m.cpu for m in shares), {k: v for m in shares for k, v in m.runs.items()},
                  {k: v for m in shares for k, v in m.planned.items()}, None if None in ends else max(ends),
                  {k: v for m in shares for k, v in m.launched.items()})


def ended_unseen(root, matrix, statuses, now, stale_after_min):
    """run -> (state, what is known) of each run matrix.log calls running that ended without a word (runs.stopped_state:
    its launcher killed with it, a node lost). A status.json older than the run's LAUNCH line is its last attempt's:
    the trainer is starting, and it is not judged."""
    judged = {name: stopped_state(root / name, statuses[name], now, stale_after_min)
              for name, (state, _) in matrix.runs.items()
              if state == "running" and _num(statuses[name].get("updated")) >= matrix.launched.get(name, 0.0)}
    return {name: found for name, found in judged.items() if found}


def watch_view(root, stale_after_min=STALE_AFTER_MIN, now=None, log=None):
    """The matrix view as text (raises ReportError when no launcher has run in root); `log` is one launcher's
    matrix log (default: the folder's, every node's share of it together)."""
    root, now = Path(root), time.time() if now is None else now
    matrix = read_matrices(root, log)
    if matrix is None:
        raise ReportError(f"no matrix in {root} (no {log or 'matrix.log'} with a QUEUE line): start one with "
                          "run_experiments.sh")
    statuses = {name: read_json(root / name / STATUS_FILE, {}, warn) for name in matrix.runs}
    gone = ended_unseen(root, matrix, statuses, now, stale_after_min)
    counts = {state: sum(s == state and name not in gone for name, (s, _) in matrix.runs.items())
              for state in ("done", "running", "queued", "failed")}
    for state, _ in gone.values():
        counts[state] = counts.get(state, 0) + 1
    eta, gpus = wall_eta(matrix, statuses), 0 if matrix.cpu else matrix.slots * matrix.gpus_per_run
    elapsed = (matrix.ended or now) - matrix.started
    elapsed_h = elapsed / 3600
    money = (f"${elapsed_h * gpus * matrix.price:,.0f} spent, ${eta / 3600 * gpus * matrix.price:,.0f} to go "
             f"({gpus} GPU(s) at ${matrix.price:g} per GPU-hour)" if gpus and math.isfinite(eta) else
             "no GPU-hours (CPU)" if not gpus else f"${elapsed_h * gpus * matrix.price:,.0f} spent")
    width = max([22] + [len(name) for name, (state, _) in matrix.runs.items() if state == "running"])
    lines = [f"Matrix {root} at {time.strftime('%H:%M:%S', time.localtime(now))}: "
             + ", ".join(f"{n} {state}" for state, n in counts.items())
             + f"; {clock(elapsed)} elapsed{'' if matrix.ended is None else ' (ended)'}, {clock(eta)} to go; "
             f"{money}",
             f"{'GPU':<8} {'run':<{width}} {'step':>14} {'loss':>8} {'amax_fwd':>9} {'tok/s':>9} {'ETA':>9}"]
    for name, (state, where) in matrix.runs.items():
        if state != "running":
            continue
        st = statuses[name]
        step = f"{st.get('step', 0):,}/{st.get('steps', 0):,}" if st.get("steps") else "starting"
        stale = now - (st.get("updated") or now) > stale_after_min * 60
        speed = _num(st.get("tokens_per_s"))
        lines.append(f"{where or '-':<8} {name:<{width}} {step:>14} {fmt_loss(_num(st.get('loss'))):>8} "
                     f"{fmt_gain(_num(st.get('amax_fwd'))):>9} {f'{speed:,.0f}' if math.isfinite(speed) else '–':>9} "
                     f"{clock(st.get('eta_s')):>9}"
                     + (f"  {gone[name][1]}" if name in gone else
                        f"  STALE: status.json unchanged for {(now - st['updated']) / 60:.0f} min" if stale else ""))
    for group in ("done", "queued", "failed"):
        names = [name for name, (state, _) in matrix.runs.items() if state == group]
        if names:
            lines.append(f"{group}: " + ", ".join(
                f"{name} {statuses[name].get('state', '')}".rstrip() for name in names)
                + (" (matrix.log says why)" if group == "failed" else ""))
    return "\n".join(lines)
