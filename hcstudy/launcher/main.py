"""The launcher's entry (python -m hcstudy.launcher, started by run_experiments.sh): --probe-gpu, the setup's
checks, then --summary, --slurm, --dry-run or the run."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import sys

from hcstudy import ROOT
from hcstudy.launcher.dry_run import JobsRefused, check_before_launch, dry_run, fill_node, this_node
from hcstudy.launcher.jobs import discover_gpus, matrix_jobs
from hcstudy.launcher.options import (EXIT_FAILED, EXIT_SIGINT, EXIT_USAGE, PROG, USAGE, RunError, UsageError,
                                      extra_value, parse_options, warn)
from hcstudy.launcher.queue import Bash, LauncherGone, MatrixRun
from hcstudy.launcher.slurm import submit_slurm
from hcstudy.launcher.summary import summary


def probe_gpu():
    """The default GPU health probe (run with CUDA_VISIBLE_DEVICES=one GPU): an allocation, a matmul, and its
    result checked against the CPU's. The last line printed is the reason the launcher logs."""
    import torch
    if not torch.cuda.is_available():
        print("CUDA is not available")
        return 1
    a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    got = (a.cuda() @ a.cuda()).cpu()
    torch.cuda.synchronize()
    if not torch.allclose(got, a @ a, rtol=1e-3, atol=1e-2):
        print("matmul result differs from the CPU")
        return 1
    print("ok", torch.cuda.get_device_name(0))
    return 0


def check_setup(opt):
    data, preset = extra_value(opt.extra, "--data"), opt.preset
    if data == "c4" or not data and (preset or "c4") == "c4":
        warn("these runs stream C4 (--data c4) from the Hugging Face Hub: this node must reach huggingface.co for the "
             "whole run, or prefetch shards and pass -- --data '/path/c4/*.json.gz'"
             + (" (HF_HUB_OFFLINE is set: only what is in the HF cache can be read)"
                if os.environ.get("HF_HUB_OFFLINE") else ""))
    if os.environ.get("RUN_EXPERIMENTS_TRAINER"):
        return
    if not (ROOT / "train_c4.py").is_file():
        raise RunError(f"{ROOT / 'train_c4.py'} not found")
    if importlib.util.find_spec("torch") is None:
        raise RunError(f"{sys.executable} cannot import torch; run 'bash setup.sh' to create .venv")


def main(argv):
    if argv[:1] == ["--probe-gpu"]:
        return probe_gpu()
    try:
        opt = parse_options(argv)
    except (UsageError, argparse.ArgumentTypeError) as error:
        print(f"{PROG}: error: {error}\nUsage: {USAGE}\nTry 'bash {PROG} --help' for more.", file=sys.stderr)
        return EXIT_USAGE
    try:
        if opt.summary:
            return summary(opt)
        check_setup(opt)
        jobs = matrix_jobs(opt)
        if opt.slurm:
            return submit_slurm(opt, jobs)
        gpus = discover_gpus(opt)
        node = this_node(opt, gpus)
        fill_node(opt, jobs, node.gpus)
        if opt.gpus_per_run == 1 and extra_value(opt.extra, "--parallel") == "fsdp":
            raise UsageError("-- --parallel fsdp shards a run over its GPUs under torchrun: give --gpus-per-run 2 "
                             "or more")
        if opt.dry_run:
            return dry_run(opt, jobs, node)
        if opt.requests is None:
            raise RunError("the matrix runs through run_experiments.sh (this process only decides): bash "
                           "run_experiments.sh " + shlex.join(argv))
        # the check imports torch and counts each arm's work: seconds with nothing on the screen otherwise
        print(f"{PROG}: planning {sum(j.node == opt.node_rank for j in jobs)} job(s): train_c4.py checks each one's "
              "flags and memory and estimates its time before the first launch", flush=True)
        check_before_launch(opt, jobs, node)
        try:
            opt.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RunError(f"cannot create {opt.out}: {error.strerror}") from None
        # Ctrl-C reaches this process with the launcher (one process group): the launcher relays it, in order
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return MatrixRun(opt, jobs, gpus, Bash(opt.requests, opt.replies)).run()
    except RunError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    except UsageError as error:      # what only the node or the matrix shows is wrong: nothing was launched
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except JobsRefused as error:
        for line in str(error).splitlines():
            print(f"{PROG}: error: {line}", file=sys.stderr)
        print(f"{PROG}: nothing was launched", file=sys.stderr)
        return EXIT_USAGE
    except LauncherGone:
        return EXIT_FAILED
    except KeyboardInterrupt:        # Ctrl-C during a dry run or its calibration
        return EXIT_SIGINT
