"""hcstudy/failures.py: a failure turned into its exit code and one line, the code the launcher acts on."""
import errno
from types import SimpleNamespace

import pytest
import torch

from hcstudy import contract
from hcstudy.failures import classify_failure, failure

ONE_PROCESS = SimpleNamespace(world=1, rank=0)


@pytest.mark.parametrize("error, code, reason", [
    (torch.OutOfMemoryError("CUDA out of memory"), contract.EXIT_OOM,
     "out of memory at micro-batch 8; retry with --micro-batch-size 4"),
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:1234. This is typically "
                  "caused by ..."), contract.EXIT_DEVICE, "lost contact with the other ranks (Connection closed by "
                                                          "peer [10.0.0.2]:1234)"),
    (RuntimeError("CUDA error: an illegal memory access was encountered\nmore"), contract.EXIT_DEVICE,
     "device or communication error: CUDA error: an illegal memory access was encountered"),
    (KeyboardInterrupt(), contract.EXIT_INTERRUPTED, "interrupted before the first step"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"), 1,
     "No space left on device: /runs/x/metrics.jsonl"),
    (ValueError("bad value\nsecond line"), 1, "ValueError: bad value"),
    (contract.ConfigError("--depth: must be at least 1"), contract.EXIT_BAD_CONFIG, "--depth: must be at least 1"),
])
def test_each_failure_gets_its_exit_code_and_one_line(error, code, reason):
    assert classify_failure(error, 8) == (code, reason)


def test_out_of_memory_without_a_known_micro_batch_halves_two_and_never_goes_below_one():
    assert classify_failure(torch.OutOfMemoryError(), None)[1].endswith("--micro-batch-size 1")
    assert classify_failure(torch.OutOfMemoryError(), 1)[1].endswith("--micro-batch-size 1")


def test_a_failure_already_recorded_keeps_its_code_and_a_lone_process_owns_its_failure():
    assert failure(contract.RunFailed(3, "diverged at step 7"), ONE_PROCESS) == (3, "diverged at step 7", True)
    assert failure(contract.Diverged("loss is NaN"), ONE_PROCESS) == (contract.EXIT_DIVERGED, "loss is NaN", True)
    assert failure(RuntimeError("NCCL timeout"), ONE_PROCESS, micro=4)[::2] == (contract.EXIT_DEVICE, True)
