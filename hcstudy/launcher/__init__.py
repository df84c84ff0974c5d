"""The launcher: the decisions behind run_experiments.sh (which starts `python -m hcstudy.launcher`); bash keeps
process control (process groups, GPU probes, signals, waiting), everything that parses, validates, plans or decides
is here. Standard library only: every job's flags, memory and time are judged by the trainer itself, in a
subprocess (`train_c4.py --plan-jobs`). Without `--requests FD --replies FD` (tests, a plain
`python -m hcstudy.launcher --dry-run`) only --help, --summary and --dry-run work. Modules, each importing only
those above it:

    options   the command line, Options, the RUN_EXPERIMENTS_* knobs, the usage and the one-line errors
    jobs      the matrix's jobs in queue order (arms, run names, what --out holds), the GPUs, trainer command lines
    summary   --summary and the end-of-matrix report
    dry_run   every job planned by the trainer (--plan-jobs), --calibrate, wall time and cost, the dry run's text
    slurm     --slurm: the matrix as a SLURM job array and a report job after it
    queue     the run (MatrixRun): the queue, the slots, what each exit code means, the conversation with bash
    main      the entry: --probe-gpu, the setup's checks, then one of the above
"""
