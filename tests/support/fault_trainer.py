"""train_c4.py with one fault installed from outside, for the tests of what the trainer does when things break.

    python tests/support/fault_trainer.py TRAIN_C4_FLAGS...     (run like train_c4.py, directly or under torchrun)

Production code has no fault hook: this script patches train_c4's classes, then calls train_c4.main.
TRAIN_C4_INJECT_NAN="WHAT:STEP[:RANK]": at optimizer step STEP (on RANK, default every rank) WHAT is
  data  the embedded batch made non-finite (token ids cannot hold a NaN: the data's first floating-point form)
  loss  the loss made non-finite        grad  a gradient set to inf after the backward
  hang  the rank sleeps a day after the forward (the others must time out, not wait forever)
  oom   an out-of-memory error after the forward (one rank failing alone: the others must name it and stop)
TRAIN_C4_FAIL_DEVICES: device ids that behave as dead GPUs: a device error before the first step when one of
  them is in CUDA_VISIBLE_DEVICES.
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from hcstudy import contract, optim  # noqa: E402
import train_c4  # noqa: E402
from hcstudy.distributed import unwrap


def injected() -> tuple[str, int]:
    """(what, step) of TRAIN_C4_INJECT_NAN on this rank, ('none', 0) when it does not apply here."""
    what, step, *only = (os.environ.get("TRAIN_C4_INJECT_NAN") or "none:0").split(":")
    if only and int(only[0]) != int(os.environ.get("RANK", "0")):
        return "none", 0
    return what, int(step)


def forward_fault(what: str):
    """A forward hook on the model (data: on its embedding) that breaks the output as `what` says."""
    def hook(module, args, output):
        if what == "hang":
            time.sleep(24 * 3600)
        if what == "oom":
            raise train_c4.torch.OutOfMemoryError("injected by TRAIN_C4_INJECT_NAN")
        if what == "loss":
            return output[0], output[1] * float("nan")
        return output * float("nan")
    return hook


def install(what: str, at_step: int) -> None:
    optimizer_step, run = train_c4.Trainer.optimizer_step, train_c4.Trainer.run

    def faulty_optimizer_step(self, stop):
        if self.step + 1 != at_step or what == "none":
            return optimizer_step(self, stop)
        model = unwrap(self.model)
        handle = (model.wte if what == "data" else model).register_forward_hook(forward_fault(what)) \
            if what != "grad" else None
        accumulate = optim.accumulate

        def accumulate_then_fault(*args):       # the gradients made, before the clip reads them
            result = accumulate(*args)
            if what == "grad":
                next(self.model.parameters()).grad.fill_(float("inf"))
            return result
        optim.accumulate = accumulate_then_fault
        try:
            return optimizer_step(self, stop)
        finally:
            optim.accumulate = accumulate
            if handle is not None:
                handle.remove()

    def run_on_failing_devices(self, stop):
        failing = set(filter(None, os.environ.get("TRAIN_C4_FAIL_DEVICES", "").split(",")))
        visible = set(filter(None, os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")))
        if failing & visible:
            raise contract.DeviceFailure(f"device error on GPU {','.join(sorted(failing & visible))} (injected by "
                                         "TRAIN_C4_FAIL_DEVICES)")
        return run(self, stop)

    train_c4.Trainer.optimizer_step, train_c4.Trainer.run = faulty_optimizer_step, run_on_failing_devices


if __name__ == "__main__":
    install(*injected())
    sys.exit(train_c4.main())
