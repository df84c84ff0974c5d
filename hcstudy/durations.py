"""Seconds as people read them, written one way everywhere: a duration or a range of them in the unit that suits
(the planner's estimate, the launcher's plans), and a clock H:MM:SS (the matrix view, SLURM's --time)."""
import math

# (below this many seconds, the unit's seconds, its name)
UNITS = ((1e-3, 1e-6, "us"), (1, 1e-3, "ms"), (120, 1, "s"), (7200, 60, "min"), (math.inf, 3600, "h"))


def duration(*seconds: float) -> str:
    """Seconds, or a range of them (low, high), in the unit that suits the largest, three significant digits below
    100 (a node's $20 an hour makes a tenth of an hour count): 45 s, 120-190 ms, 3.12-4.6 min, 10.5-19.7 h."""
    scale, unit = next((scale, unit) for limit, scale, unit in UNITS if max(seconds) < limit)
    return "-".join(f"{v / scale:.3g}" if v / scale < 100 else f"{v / scale:.0f}" for v in seconds) + " " + unit


def clock(seconds) -> str:
    """H:MM:SS (hours past 24 as they are), whole seconds rounded up: SLURM's --time covers the plan; – where the
    time is not known."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "–"
    seconds = math.ceil(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
