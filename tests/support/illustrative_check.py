"""An illustrative GPU check's result.json: made up for the tests and for docs/planning.md's dry run after a check,
not a measurement. Its rehearsals are rows of shapes the --full matrix plans for one H100 (contract.rehearsal_row,
the configs the trainer parses): the baseline at depth 48 and mHC at depth 32 trained, HC at depth 48 ran out of
memory at its planned micro-batch 2, mHC at depth 48 one above its plan."""
from hcstudy import gpu_check
from hcstudy.config import parse_config
from hcstudy.contract import rehearsal_row
from hcstudy.model import count_parameters
from hcstudy.planner import gpus, rehearsed

GPU = gpus.ASSUMED_GPU
LABEL = "illustrative: made up by tests/support/illustrative_check.py, not measured"
# (method, depth, micro-batch, global batch, path, status, median step, [fastest, slowest], peak GiB, planned GiB,
# modelled [low, high], over the plan)
ROWS = [("baseline", 48, 4, 32, "reference", "ok", 1.41, [1.39, 1.44], 55.0, 58.1, [1.15, 1.92], False),
        ("hc", 48, 2, 32, "triton", "oom", None, None, 78.9, 63.8, [1.81, 3.34], False),
        ("mhc", 32, 8, 32, "triton", "ok", 1.58, [1.55, 1.62], 68.4, 70.1, [1.00, 1.77], False),
        ("mhc", 48, 3, 30, "triton", "oom", None, None, 78.8, 66.7, [1.70, 3.11], True)]


def row(method, depth, micro, batch, path, status, step, spread, peak, planned, modelled, over_plan):
    cfg = parse_config(["--residual", method, "--depth", str(depth), "--batch-size", str(batch),
                                "--micro-batch-size", str(micro)])
    flops = gpus.flops_per_token(cfg, count_parameters(cfg))
    tokens_per_s = cfg.batch_size * cfg.seq_len / step if step else None
    return rehearsal_row(
        gpu=GPU, method=method, depth=depth, width=cfg.width, seq_len=cfg.seq_len, batch_size=batch, micro_batch=micro,
        activation_checkpointing=False, stream_dtype="fp32", compile=False, kernels=path, variant=[],
        config=rehearsed.step_config(cfg), over_plan=over_plan, status=status,
        reason="" if status == "ok" else "OutOfMemoryError: CUDA out of memory (illustrative)", step_s=step,
        step_s_spread=spread, steps_timed=3 if step else 0, tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * flops / gpus.gpu_peak_flops(GPU) if step else None, peak_alloc_gib=peak,
        planned_alloc_gib=planned, modelled_step_s=modelled)


def write(out, rows=ROWS) -> list:
    """{out}/gpu_check/result.json with these rows (and no timings), as the check writes it; the rows."""
    made = [row(*values) for values in rows]
    gpu_check.write_result(out, {"gpu": GPU, "illustrative": LABEL}, {}, {}, made)
    return made
