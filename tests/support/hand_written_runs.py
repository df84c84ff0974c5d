"""Run folders written by hand as train_c4.py writes them, for the report's tests (tests/report/): the lines of
metrics.jsonl, status.json, config.json, and readers of the tables report.py writes."""
import json
import math
import time


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(root, name, lines, state="completed", config=None, world_size=1, device="cuda",
              tail="", with_config=True, updated=None, device_at_top=False):
    """A run folder as train_c4.py writes it; `tail` is appended raw (e.g. a half-written line)."""
    method, depth, seed = name.split("_")
    d = root / name
    d.mkdir(parents=True)
    if with_config:
        cfg = {"residual": method, "depth": int(depth[1:]), "seed": int(seed[1:]), "width": 64, "steps": 10,
               "batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "expansion": 4, "run_name": name,
               "grad_clip": 1.0, **(config or {})}
        record = {"config": cfg, "n_params": 1000, "world_size": world_size, "versions": {}, "git_commit": "x"}
        (record if device_at_top else cfg)["device"] = device       # train_c4.py writes it at the top
        (d / "config.json").write_text(json.dumps(record))
    text = "".join(json.dumps(rec) + "\n" for rec in lines) + tail     # json writes NaN/Infinity
    (d / "metrics.jsonl").write_text(text)
    last = max((rec["step"] for rec in lines), default=0)
    (d / "status.json").write_text(json.dumps({"state": state, "step": last, "exit_code": 0,
                                               "reason": None, "updated": updated}))
    return d


def probe(fwd, bwd, l0f=1.0, l0b=1.0):
    return {"amax_fwd": fwd, "amax_bwd": bwd, "amax_l0_fwd": l0f, "amax_l0_bwd": l0b,
            "amax_fwd_abs": fwd, "amax_bwd_abs": bwd, "min_row_sum": 1.0, "min_col_sum": 1.0}


def train(step, t, loss, gn, tokens):
    return {"step": step, "time": t, "loss": loss, "lr": 1e-4, "grad_norm": gn, "clipped": gn > 1.0,
            "tokens": tokens, "tokens_per_s": 10.0, "mfu": None, "mem_peak_gb": None}


def hc_seed1(root):
    """Training + probe lines share a step; val on its own lines. Time span 31 s."""
    return write_run(root, "hc_d4_s1", [
        {**train(1, 1000.0, 5.0, 2.0, 100), **probe(1.0, 1.0)},
        train(2, 1010.0, 4.0, 0.5, 200),
        {"step": 2, "time": 1011.0, "val_loss": 4.5},
        {**train(3, 1020.0, 3.0, 3.0, 300), **probe(12.0, 5.0, 1.5, 1.2)},
        {**train(4, 1030.0, 2.0, 0.9, 400), **probe(150.0, 120.0, 1.4, 1.3)},
        {"step": 4, "time": 1031.0, "val_loss": 3.5},
    ])


def hc_seed2(root):
    """The 10x level is crossed by amax_bwd only (step 2); 100x never; val best before final."""
    return write_run(root, "hc_d4_s2", [
        {**train(1, 2000.0, 6.0, 0.5, 100), **probe(1.0, 1.0)},
        {**train(2, 2010.0, 3.0, 4.0, 200), **probe(8.0, 11.0, 1.1, 1.0)},
        {"step": 2, "time": 2011.0, "val_loss": 3.0},
        {**train(3, 2020.0, 3.5, 0.8, 300), **probe(50.0, 40.0, 1.7, 1.9)},
        train(4, 2030.0, 3.0, 0.7, 400),
        {"step": 4, "time": 2041.0, "val_loss": 3.25},
    ])


def table_cells(out_dir, label, depth, section="## Full table"):
    """{header: cell} of the row `label` (e.g. 'HC') at `depth` of the first table after `section` in results.md."""
    lines = (out_dir / "results.md").read_text().split(section + "\n", 1)[1].splitlines()
    header = next(ln for ln in lines if ln.startswith("| method |"))
    heads = [h.strip() for h in header.strip("|").split("|")]
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) == len(heads) and cells[0] == label and cells[1] == str(depth):
            return dict(zip(heads, cells))
    raise AssertionError(f"no row {label} depth {depth} in results.md")


def sample_std(a, b):
    return abs(a - b) / math.sqrt(2)      # ddof=1 standard deviation of two values


def mhc_probe(used_bwd, converged_bwd, col_err, bound):
    return {**probe(1.0, used_bwd), "amax_study": used_bwd, "amax_fwd_converged": 1.0,
            "amax_bwd_converged": converged_bwd, "sinkhorn_col_err": col_err, "sinkhorn_bwd_bound": bound}


def with_layers(lines, depth, gain):
    for i, rec in enumerate(lines):
        if "amax_fwd" in rec:
            rec["layer_gain_fwd"] = [gain ** ((k % 3) - 1) * (1 + 0.1 * i) for k in range(2 * depth)]
            rec["layer_gain_bwd"] = [1.0 + 0.01 * k for k in range(2 * depth)]
    return lines


def matrix_lines(method, scale, n=60):
    lines = []
    for step in range(1, n + 1):
        rec = train(step, float(step), 5.0 - step / n + 0.05 * (step % 3), 0.3 + (step % 7) / 5, step * 10)
        if step % 5 == 0:
            rec.update(probe(scale ** (step / n), scale ** (step / n) * 0.9))
        if step % 10 == 0:
            lines.append({"step": step, "time": step + 0.5, "val_loss": 4.9 - step / n})
        lines.append(rec)
    return with_layers(lines, 4, 1.5 if method == "hc" else 1.0)


def killed_matrix(root, **status):
    """A matrix whose launcher died with its job: matrix.log's last word on hc_d4_s1 is its LAUNCH, 2 hours ago, and
    the run's status.json says running at step 21 with checkpoint step-20."""
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000%z", time.localtime(now - 7200))
    (root / "matrix.log").write_text(
        f"{stamp} QUEUE slots=1 gpus_per_run=1 gpus=0 price_per_gpu_hour=0 runs=hc_d4_s1\n"
        f"{stamp} LAUNCH hc_d4_s1 gpus=0 attempt=1\n")
    d = write_run(root, "hc_d4_s1", [train(step, float(step), 4.0, 0.5, 10 * step) for step in range(1, 22)],
                  state="running", updated=now)
    record = json.loads((d / "status.json").read_text())
    (d / "status.json").write_text(json.dumps(record | {"step": 21, "steps": 40, "last_checkpoint_step": 20,
                                                        **status}))
    return d


def stream_readings(dominance, streams, rank, res, uniform, permutation):
    """A probe's ten stream readings: the table's six columns, and 0.1 for the others (in results.csv only)."""
    return {"stream_dominance": dominance, "effective_streams": streams, "effective_rank": rank,
            "res_to_identity": res, "composite_to_uniform": uniform, "composite_to_permutation": permutation,
            "stream_dominance_mean": 0.1, "effective_streams_min": 0.1, "effective_rank_min": 0.1,
            "res_to_identity_mean": 0.1}


def stream_lists(depth, value):
    return {key: [value] * (2 * depth) for key in ("layer_gain_fwd", "layer_gain_bwd", "layer_stream_dominance",
                                                   "layer_effective_streams", "layer_effective_rank",
                                                   "layer_res_to_identity")}


def stream_run(root, name, gains, final=None, dominance_list=None):
    """Two probes: the first logs 0.9 for every reading and list, the last `final` and lists of `dominance_list`
    (the report reads the last); `gains` = the last probe's (amax_fwd, amax_bwd). None: not logged (older runs)."""
    depth = int(name.split("_")[1][1:])
    first, last = {**train(1, 1.0, 5.0, 0.5, 10), **probe(1.0, 1.0)}, {**train(2, 2.0, 4.0, 0.5, 20), **probe(*gains)}
    if final is not None:
        first.update(stream_readings(*[0.9] * 6), **stream_lists(depth, 0.9))
        last.update(final, **stream_lists(depth, dominance_list))
    return write_run(root, name, [first, last])


def stream_matrix(root, depths=(4, 8)):
    """Baseline (no readings), HC and mHC at each depth, seeds 1 and 2; at depth 8 an older HC run (seed 3)."""
    for depth in depths:
        for seed in (1, 2):
            stream_run(root, f"baseline_d{depth}_s{seed}", (1.0, 1.0))
            stream_run(root, f"mhc_d{depth}_s{seed}", (1.0, 1.1), stream_readings(0.3, 3.9, 3.8, 0.2, 0.01, 0.99),
                       0.25)
    stream_run(root, "hc_d4_s1", (100.0, 300.0), stream_readings(0.5, 2.5, 1.25, 0.75, 1200.0, 1.5), 0.3)
    stream_run(root, "hc_d4_s2", (200.0, 100.0), stream_readings(0.8, 2.0, 1.5, 0.25, 1800.0, 2.5), 0.5)
    if 8 in depths:
        stream_run(root, "hc_d8_s1", (2000.0, 1000.0), stream_readings(0.6, 2.0, 1.0, 1.0, 5000.0, 4.0), 0.6)
        stream_run(root, "hc_d8_s2", (1000.0, 4000.0), stream_readings(0.7, 1.5, 1.0, 1.25, 7000.0, 6.0), 0.8)
        stream_run(root, "hc_d8_s3", (1500.0, 10.0))
