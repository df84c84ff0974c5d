"""The published figures beside ours (results.md's reference block and the verdict), in one place: where from,
the method, the depth of the model (None: not ours to match), the figure, and which of our readings and arms
compares."""
from __future__ import annotations

import math
from typing import NamedTuple

from hcstudy.contract import STUDY_TRAIN_KEY
from hcstudy.report.runs import METHOD_LABEL
from hcstudy.report.tables import fmt_gain, markdown


class Published(NamedTuple):
    """One published figure: where from, the method, the depth of the model (None: not ours to match), the figure as
    published, which of our readings and arms compares, and the figure as a number (± its spread over seeds) for
    the depth-trend plot."""
    source: str
    method: str
    depth: int | None
    figure: str
    fields: tuple
    coefficients: str
    value: float
    spread: float = 0.0


# The papers measure per token (our amax_fwd/amax_bwd, token coefficients), the study with its own recipe on its own
# training batch at every step (our amax_study_train) on its model (the arms study-hc and study-mhc).
PAPERS_27B = "mHC paper (arXiv 2512.24880), 27B"
STUDY = "public 1.7B study"
PUBLISHED = (
    Published(PAPERS_27B, "hc", None, "up to about 3000", ("peak_fwd", "peak_bwd"), "token", 3000.0),
    Published(PAPERS_27B, "mhc", None, "at most about 1.6", ("peak_fwd", "peak_bwd"), "token", 1.6),
    Published(f"{STUDY}, 3 seeds", "study-hc", 32, "10,924 ± 3,247", ("peak_study_train",), "sequence", 10924.0, 3247.0),
    Published(STUDY, "study-hc", 48, "3,721", ("peak_study_train",), "sequence", 3721.0),
    Published(f"{STUDY}, stress record", "study-hc", 48, "3,814", ("peak_study_train",), "sequence", 3814.0),
    Published(f"{STUDY}, stress arm (3x lr)", "study-hc", 64, "14,765", ("peak_study_train",), "sequence", 14765.0),
    Published(STUDY, "study-mhc", 32, "1.00", ("peak_study_train",), "sequence", 1.0),
)
READING = {("peak_fwd", "peak_bwd"): "amax_fwd / amax_bwd", ("peak_study_train",): STUDY_TRAIN_KEY}


def published_matches(rows, method, depth, fields, coefficients):
    """'amax_fwd 43.6 / amax_bwd 42.7 (label, depth d)' of each of our rows that compares with one published figure,
    each reading named (a forward and a backward figure are never read as one); the study's figures with its own
    model only (its arms study-hc and study-mhc: the published rows name them)."""
    found = []
    for row in rows:
        if (row.method, row.coefficients) != (method, coefficients) or depth not in (None, row.depth):
            continue
        values = [f"{f.replace('peak_', 'amax_')} {fmt_gain(row.stats[f].mean)}" for f in fields
                  if not math.isnan(row.stats[f].mean)]
        if values:
            found.append(f"{' / '.join(values)} ({row.label}, depth {row.depth})")
    return found


def reference_block(rows):
    """results.md's reference block: the published figures, the reading and arm of ours each compares with,
    and our figure where this report has that arm."""
    columns = [("published", lambda p: p.source), ("method", lambda p: METHOD_LABEL[p.method]),
               ("depth", lambda p: "–" if p.depth is None else str(p.depth)),
               ("peak composite gain", lambda p: p.figure),
               ("our reading", lambda p: READING[p.fields]),
               ("our arm", lambda p: "token coefficients (default)" if p.coefficients == "token" else
                "the study's own (--residual study-hc, study-mhc)"),
               ("ours here", lambda p: "; ".join(published_matches(rows, p.method, p.depth, p.fields,
                                                                 p.coefficients)) or "no such run")]
    return [markdown(columns, PUBLISHED), "",
            "The papers' figures are per token, on a 27B model: compare them with amax_fwd and amax_bwd of our "
            "token-coefficient arms. The public study's figures are the peak over training steps of its own recipe "
            f"(H averaged over the training batch, multiplied in reverse order over the full depth, the larger of "
            f"the largest absolute row and column sums: our {STUDY_TRAIN_KEY}, logged every step) on its own model: "
            f"compare them with {STUDY_TRAIN_KEY} of our study-hc and study-mhc arms, not with our "
            "per-token readings nor the probe's amax_study (held-out batch, every --metrics-every steps)."]


def reference_verdict(rows):
    """One verdict line: our figures beside the published ones they compare with."""
    pairs = [f"{METHOD_LABEL[p.method]} {', '.join(ours)} against {p.figure} ({p.source}"
             + (f", depth {p.depth})" if p.depth else ")")
             for p in PUBLISHED
             for ours in [published_matches(rows, p.method, p.depth, p.fields, p.coefficients)] if ours]
    if not pairs:
        return ("**published figures**: no arm here compares directly (per-token amax_fwd/amax_bwd of HC or mHC "
                f"for the papers, {STUDY_TRAIN_KEY} of study-hc and study-mhc for the public study); see the reference "
                "block.")
    return "**published figures**: " + "; ".join(pairs) + "."
