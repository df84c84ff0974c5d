"""hcstudy: everything of the HC vs mHC study that a user does not run by hand. The entry points live beside it:
train_c4.py (the trainer), report.py, torchrun.py, run_experiments.sh, setup.sh. The package never imports the trainer
(the trainer passes what it needs) and its imports form a tree: contract.py at the root, standard library only.

    contract.py             what two processes share: exit codes, the trainer's errors, run names, metric keys, formats
    config_flags.py         Config's fields as command-line flags; one-line argparse errors for every entry point
    failures.py             a failure turned into its exit code and one line
    run_folder.py           the run folder's files, the lock, and the checkpoint protocol (write, verify, fall back)
    finite_state.py         whether a checkpoint's state holds a NaN or an infinity: one pass on its device
    run_record.py           config.json's record of what produced a run; train.log's opening
    progress.py             the pace while a run trains: a bar or log lines, status.json's live fields
    wandb_log.py            Weights & Biases on rank 0, never stopping training
    readahead.py            the trainer's data read ahead in loader processes or a thread
    c4_download.py          C4's shards downloaded once per node (setup.sh --prefetch-c4)
    consolidate.py          a checkpoint's weights in one file (train_c4.py --consolidate)
    gpu_check.py            run_experiments.sh --check: the GPU path on one card, its timings for the planner
    check_parts.py          the check's parts in one process with the trainer: timings, the real sizes rehearsed
    kernels/choice.py       which path runs the streams (--kernels) and attention (--attn): asked, timed, self-checked
    kernels/cross_entropy.py  the loss's two paths (--cross-entropy): plain logits or torch's chunked op; auto's pick
    kernels/fused.py        hand-written autograd Functions for HC and mHC (any device)
    kernels/triton_kernels.py  the Triton kernels themselves, imported at their first launch
    kernels/triton_library.py  the kernels' launches as torch.library operators: what torch.compile traces
    kernels/triton_ops.py   the Triton path of the connections: autograd Functions over the operators, byte counts
    planner/gpus.py         the cards' spec sheets; FLOPs per token
    planner/memory.py       the memory plan of one GPU; the micro-batch
    planner/step_work.py    a step's kernels, bytes and FLOPs, counted on the real model
    planner/run_time.py     a step and a run priced at a card's (or this CPU's) rates, or as measured
    planner/rehearsed.py    the check's rehearsals read back: a job shape's measured step, its micro-batches that failed
    planner/estimate.py     train_c4.py --estimate's text
    planner/plan_jobs.py    train_c4.py --plan-jobs: the launcher's check of every job
    durations.py            durations as people read them (the dry run, the live view, the planner)
    launcher/options.py     the launcher's command line, its RUN_EXPERIMENTS_* knobs, its one-line errors
    launcher/jobs.py        the matrix's jobs in queue order, the GPUs, each job's trainer command line
    launcher/summary.py     --summary and the end-of-matrix report
    launcher/dry_run.py     every job planned by the trainer (--plan-jobs): wall time and cost, the dry run's text
    launcher/slurm.py       --slurm: the matrix as a SLURM job array
    launcher/queue.py       the matrix run: the queue, the slots, what each exit code means, the talk with bash
    launcher/main.py        python -m hcstudy.launcher (run_experiments.sh starts it)
    report/runs.py          run folders read for the report, defensively
    report/aggregate.py     one summary per run, one row per arm and depth
    report/tables.py        results.md's tables and the CSV files
    report/verdict.py       the verdict and the headline per depth
    report/published.py     the published figures beside ours
    report/plots.py         the report's figures
    report/live.py          the live matrix view (report.py --watch, run_experiments.sh --summary)
    report/command.py       report.py's command line

docs/architecture.md shows how a run flows through them.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent        # the repository: the entry points the launcher starts
