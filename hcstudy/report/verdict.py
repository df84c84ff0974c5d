"""The verdict: one paragraph per depth, stated only from the aggregated numbers, and the headline per depth."""
from __future__ import annotations

import math

from hcstudy.report.aggregate import FLAT, THRESHOLDS
from hcstudy.report.runs import CORE_METHODS, METHOD_LABEL
from hcstudy.report.tables import crossing, fmt_dev, fmt_gain, fmt_loss, fmt_stat, per_seed, seeds_text


def _spread(stat):
    """How a mean over seeds was formed, for the verdict."""
    if math.isinf(stat.mean):
        return f"non-finite in at least one of {seeds_text(stat.n)}"
    if stat.n == 1:
        return "1 seed"
    return f"mean of {seeds_text(stat.n)}, ± {fmt_gain(stat.std, stat.mean)} sample std"


def _progress(row):
    states = {}
    for r in row.runs:
        states[r.state] = states.get(r.state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(states.items()))


def _crossed(row, threshold):
    if all(r.first_above[threshold] is None for r in row.runs if r.has_probe):
        return f"never above {threshold:g}×"
    return f"first above {threshold:g}× at step {per_seed(row, crossing(threshold))} (per seed)"


def truncation_evidence(converged):
    """mHC runs with converged gains: (distance of the converged gains from 1, whether every as-used backward
    gain stays under its truncation bound). Both small/true: the as-used distance from 1 is truncation."""
    conv_dev = max(abs(r.peak_converged - 1) for r in converged)
    return conv_dev, all(r.peak_bwd <= r.peak_bwd_bound * (1 + 1e-9) for r in converged)


def truncation(row, probed):
    """mHC: whether the as-used gains' distance from 1 is Sinkhorn truncation (words), or ''."""
    converged = [r for r in probed if not math.isnan(r.peak_converged)]
    if not converged:
        return ""
    conv_dev, within = truncation_evidence(converged)
    left = max((r.converged_err for r in converged if not math.isnan(r.converged_err)), default=math.nan)
    reached = "" if math.isnan(left) else f" (every row and column sum within {fmt_dev(left)} of 1)"
    bound, err = max(r.peak_bwd_bound for r in converged), max(r.peak_col_err for r in converged)
    if conv_dev < 1e-3 and within:
        return (f" Projected to convergence{reached} the same mixing logits give 1 ± {fmt_dev(conv_dev)}; the as-used "
                f"backward gain (up to {fmt_gain(max(r.peak_bwd for r in converged))}) stays under the bound "
                f"{fmt_gain(bound)} that Sinkhorn column errors of up to {fmt_dev(err)} allow: its distance from "
                "1 is truncation of the projection (--sinkhorn-iters), not amplification.")
    return (f" Projected to convergence the same mixing logits give up to 1 ± {fmt_dev(conv_dev)}"
            f"{'' if within else ', and the as-used backward gain exceeds the truncation bound'}: more than "
            "Sinkhorn truncation explains; check the probe.")


def verdict_gain(row):
    """One sentence about a method's composite gains at one depth."""
    name = row.label
    probed = [r for r in row.runs if r.has_probe]
    if not probed:
        return f"{name}: {seeds_text(len(row.runs))} ({_progress(row)}) but no probe lines yet."
    dev = max(r.max_dev for r in probed)
    if row.method == "baseline" and dev < 1e-6:
        return (f"baseline: 1 by definition (logged composite gains within 1 ± {fmt_dev(dev)}, "
                f"{seeds_text(len(probed))}).")
    if row.method == "baseline":
        return (f"baseline: logged composite gains up to {fmt_dev(dev)} away from 1 "
                "(expected exactly 1; check the probe).")
    fwd, bwd = row.stats["peak_fwd"], row.stats["peak_bwd"]
    if dev < FLAT:
        return (f"{name}: composite gains stayed within 1 ± {fmt_dev(dev)} (forward and backward, "
                f"all probe steps, {seeds_text(len(probed))}; {_progress(row)})." + truncation(row, probed))
    cross = "; ".join(_crossed(row, t) for t in THRESHOLDS)
    top = max(probed, key=lambda r: -math.inf if math.isnan(r.peak_fwd) else r.peak_fwd)
    return (f"{name}: composite forward gain peaked at {fmt_gain(fwd.mean)}× ({_spread(fwd)}; "
            f"highest {fmt_gain(top.peak_fwd)}× in seed {top.seed}), backward {fmt_gain(bwd.mean)}× "
            f"({_spread(bwd)}); {cross}; {_progress(row)}." + truncation(row, probed))


def verdict_loss(rows):
    parts = [f"{r.label} {fmt_stat(r.stats['final_val'], fmt_loss, len(r.runs))}"
             for r in rows if r.stats["final_val"].n]
    return f"Final val loss (mean ± sample std): {', '.join(parts)}." if parts else "No val loss logged yet."


def arm_depths(rows):
    """(where, rows) per arm and depth, in table order: 'depth 48', or 'stress arm, depth 48' with several arms."""
    for arm, depth in sorted({(r.arm, r.depth) for r in rows}):
        at = [r for r in rows if (r.arm, r.depth) == (arm, depth)]
        yield (f"{arm} arm, depth {depth}" if at[0].label_arm else f"depth {depth}"), at


def headline_gain(row):
    """A few words on one method's composite gain: 'HC amplifies 45× (above 10× at step 140)', 'mHC 1.000
    (backward 1.150 from Sinkhorn truncation)'; '' for a baseline at exactly 1 (nothing to say)."""
    probed = [r for r in row.runs if r.has_probe]
    if not probed:
        return f"{row.label} not probed yet"
    if row.method == "baseline" and max(r.max_dev for r in probed) < 1e-6:
        return ""
    fwd, bwd = row.stats["peak_fwd"].mean, row.stats["peak_bwd"].mean
    converged = [r for r in probed if not math.isnan(r.peak_converged)]
    conv_dev, within = truncation_evidence(converged) if converged else (math.nan, False)
    truncated = conv_dev < 1e-3 and within
    if max(fwd, bwd) >= 1 + FLAT and not truncated:
        level = THRESHOLDS[0]
        when = (f"never above {level:g}×" if all(r.first_above[level] is None for r in probed)
                else f"above {level:g}× at step {per_seed(row, crossing(level))}")
        return f"{row.label} amplifies {fmt_gain(max(fwd, bwd))}× ({when})"
    text = f"{row.label} {fmt_gain(fwd)}"
    if fmt_gain(bwd) == fmt_gain(fwd):
        return text
    return f"{text} (backward {fmt_gain(bwd)}{' from Sinkhorn truncation' if truncated else ''})"


def headline(rows):
    """The first lines of results.md: per arm and depth, the gains in one line and the losses in another."""
    lines = []
    for where, at in arm_depths(rows):
        fewest, most = min(len(r.runs) for r in at), max(len(r.runs) for r in at)
        seeds = f"{most} seed{'s' if most > 1 else ''}" if fewest == most else f"{fewest} to {most} seeds"
        gains = [g for g in map(headline_gain, at) if g] or ["baseline only"]
        div = [f"{len(r.diverged)} of {len(r.runs)} {r.label} runs diverged" for r in at if r.diverged]
        losses = [f"{r.label} {fmt_loss(r.stats['final_val'].mean)}" for r in at if r.stats["final_val"].n]
        lines.append(f"**{where}** ({seeds}): "
                     + "; ".join(gains + div) + ".  ")
        lines.append(f"Final val loss: {', '.join(losses)}." if losses else "No val loss logged yet.")
        lines.append("")
    return lines[:-1]


def verdict(rows):
    """Markdown lines, one paragraph per arm and depth; missing methods are said, not guessed."""
    lines = []
    for where, at in arm_depths(rows):
        have = {r.method for r in at}
        parts = [verdict_gain(r) for r in at]
        parts += [f"No {METHOD_LABEL[m]} runs at depth {at[0].depth}." for m in CORE_METHODS if m not in have]
        div = [f"{len(r.diverged)} of {len(r.runs)} {r.label} runs diverged"
               for r in at if r.diverged]
        if div:
            parts.append("; ".join(div) + ".")
        parts.append(verdict_loss(at))
        lines.append(f"**{where}**: " + " ".join(parts))
    return lines
