"""Every failure of a run as its exit code and one line (the codes: contract.py; what the launcher does
with each: docs/reliability.md).

A rank that only lost contact with the others takes the reason of the rank that failed first, which that rank notes
in torchrun's rendezvous store: the launcher then acts on the root cause instead of blaming a GPU
(docs/distributed.md).
"""
import contextlib
import json
import os
import sys

import torch
from torch.distributed.distributed_c10d import _get_default_store

from hcstudy.contract import EXIT_DEVICE, EXIT_INTERRUPTED, EXIT_OOM, Diverged, Interrupted, RunFailed, TrainerError
from hcstudy.planner import memory


def failure(error: BaseException, dist, micro: int | None = None) -> tuple[int, str, bool]:
    """The one classification of a failure into (exit code, reason, whether it is this rank's own): a RunFailed
    keeps its own; a rank that only lost contact takes the reason of the rank that failed first (rank_failure)."""
    if isinstance(error, RunFailed):
        return error.exit_code, str(error), True
    code, reason = classify_failure(error, micro)
    if isinstance(error, (Diverged, Interrupted)):      # every rank stops at the same step: nothing to look up
        return code, reason, True
    return rank_failure(dist, code, reason)


def classify_failure(error: BaseException, micro: int | None) -> tuple[int, str]:
    if isinstance(error, (TrainerError, memory.PlanError)):
        return error.exit_code, str(error)
    if isinstance(error, torch.OutOfMemoryError):
        smaller = max(1, (micro or 2) // 2)
        return EXIT_OOM, f"out of memory at micro-batch {micro}; retry with --micro-batch-size {smaller}"
    text = str(error)
    if isinstance(error, RuntimeError) and "gloo/transport" in text:
        # a peer closed its connection or did not answer within the time-out: gloo's message, minus its source path
        cause = text.splitlines()[0].split("] ", 1)[-1].split(". This is typically")[0]
        return EXIT_DEVICE, f"lost contact with the other ranks ({cause})"
    if isinstance(error, torch.distributed.DistError) or (
            isinstance(error, RuntimeError) and any(key in text for key in ("CUDA error", "NCCL", "cuDNN", "Gloo"))):
        return EXIT_DEVICE, f"device or communication error: {text.splitlines()[0] if text else type(error).__name__}"
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted before the first step"
    if isinstance(error, OSError):          # the file system refused: full, quota, read-only, permission
        return 1, f"{error.strerror or error}{f': {error.filename}' if error.filename else ''}"
    return 1, f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def rank_failure(dist, code: int, reason: str) -> tuple[int, str, bool]:
    """The job's exit code and reason for a failure seen here, and whether it is this rank's own. A rank's own
    failure goes to the rendezvous store; a rank that only lost contact (code 5) reports the failure another rank
    noted, so the launcher acts on the root cause instead of blaming a GPU (docs/distributed.md)."""
    if dist.world == 1 or not torch.distributed.is_initialized():
        return code, reason, True
    attempt = f"train_c4/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/failed"
    with contextlib.suppress(Exception):                   # best effort: the store's host may be gone too
        store = _get_default_store()
        if code == EXIT_DEVICE:
            for rank in range(dist.world):
                if rank != dist.rank and store.check([f"{attempt}/{rank}"]):
                    peer_code, peer_reason = json.loads(store.get(f"{attempt}/{rank}"))
                    return peer_code, f"rank {rank} failed: {peer_reason}", False
        store.set(f"{attempt}/{dist.rank}", json.dumps([code, reason]))
    if code == EXIT_DEVICE and "lost contact" in reason:
        return code, reason + ("; no other rank reported an error: one was killed (out of host memory?) or is "
                               "hung, see torchrun's summary and the ranks' logs"), False
    return code, reason, True


def exit_process(code: int) -> None:
    """Under torchrun, leave without the interpreter's teardown: after a clean destroy_process_group, gloo's
    threads still abort about one rank exit in ten on a loaded CPU (std::terminate, SIGABRT), which turns a
    finished run's exit 0 or a saved stop's 75 into a crash. Everything the run writes is flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    if "WORLD_SIZE" in os.environ:
        os._exit(code)
    sys.exit(code)
