"""--cross-entropy: torch's chunked linear cross-entropy (hcstudy/kernels/cross_entropy.py) against the plain loss on the
logits (train_c4.GPT.forward, the reference): the loss and every gradient in fp32, the loss under bf16 autocast, under
DDP and FSDP2 (tests/support/loss_probe.py), through the command line; and which loss auto takes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hcstudy.kernels import cross_entropy
from hcstudy.model import GPT
from helpers import randomize_mixing, tiny_config

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("residual", ["baseline", "mhc"])
def test_the_fused_loss_equals_the_plain_one_with_every_gradient_in_fp32(residual):
    """The tied weight (lm_head = wte) takes the head's gradient and the embedding's, on either path.

    Tolerance: the two compute the same sums in another order (the log-sum-exp and the weight's gradient a chunk of 2
    tokens at a time, 32 chunks here): measured 1 ulp on the loss (5e-7 at 5.3) and at most 3e-8 on any gradient (of
    0.02 to 1). A fault is far above: a chunk or a token lost moves the loss by 1/64 or more, the head's gradient lost
    from the tied weight moves wte's by its whole size (mutation: `weight.detach()` in fused_cross_entropy fails)."""
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    results = {}
    for loss in ("plain", "fused"):
        torch.manual_seed(0)
        model = GPT(tiny_config(residual), loss=loss)
        randomize_mixing(model)
        logits, value = model(idx, idx)
        value.backward()
        assert (logits is None) == (loss == "fused")
        results[loss] = value.detach(), {name: p.grad for name, p in model.named_parameters()}
    (plain, plain_grads), (fused, fused_grads) = results["plain"], results["fused"]
    assert chunks_of(2 * 32, 16, 256) == 32
    torch.testing.assert_close(fused, plain, rtol=3e-7, atol=0)
    assert plain_grads.keys() == fused_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=2e-7, msg=name)


def chunks_of(tokens, width, vocab):
    return -(-tokens // cross_entropy.chunk_rows(tokens, width, vocab))


def test_under_bf16_autocast_the_loss_runs_in_bf16_and_is_averaged_in_fp32(monkeypatch):
    """Autocast does not cast a custom op's inputs: fused_cross_entropy does, so that the head's matmuls run in bf16
    as the plain Linear's do. Asked for the mean, torch's op returns it in bf16, summed over the chunks in bf16: 0.063
    from the fp64 loss of 8.3 here (mutation: reduction='mean' fails), where each token's loss rounded once to bf16
    (steps of 2^-4 at 8.3) and averaged in fp32 is 1.4e-3 from it (8e-4 expected over 512 tokens; the plain loss
    under autocast: 1.6e-4). The gradients: bf16's rounding, the weight's summed over 64 chunks in bf16, measured 9e-3
    of their norm (the plain loss under autocast: 3e-3)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 32, generator=generator, requires_grad=True)
    weight = (0.3 * torch.randn(1024, 32, generator=generator)).requires_grad_()
    targets = torch.randint(0, 1024, (512,), generator=generator)
    reference = F.cross_entropy(hidden.double() @ weight.double().T, targets)
    expected = torch.autograd.grad(reference, (hidden, weight))
    seen, op = [], F.linear_cross_entropy
    monkeypatch.setattr(cross_entropy.F, "linear_cross_entropy",
                        lambda h, w, *args, **kwargs: seen.append((h.dtype, w.dtype)) or op(h, w, *args, **kwargs))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy.fused_cross_entropy(hidden, weight, targets)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert seen == [(torch.bfloat16, torch.bfloat16)] and loss.dtype == torch.float32
    assert chunks_of(512, 32, 1024) == 64
    assert abs(loss.item() - reference.item()) < 5e-3
    for grad, want in zip(grads, expected):
        assert grad.dtype == torch.float32 and (grad.double() - want).norm() / want.norm() < 2e-2


def test_auto_takes_the_loss_check_timed_faster_on_this_gpu_else_plain():
    auto, fused = tiny_config("baseline"), tiny_config("baseline", cross_entropy="fused")
    timed = {"gpu": H100, "cross_entropy": {"plain": {"step_s": 0.5}, "fused": {"step_s": 0.4}}}
    assert cross_entropy.choose(fused, "cpu", None) == ("fused", "--cross-entropy fused")
    assert cross_entropy.choose(auto, H100, timed) == ("fused", f"auto: --check timed it faster on this {H100} "
                                                                "(0.400 s/step, 0.500 for the other)")
    slower = {**timed, "cross_entropy": {"plain": {"step_s": 0.3}, "fused": {"step_s": 0.4}}}
    assert cross_entropy.choose(auto, H100, slower)[0] == "plain"
    for unknown in ({**timed, "gpu": "NVIDIA H200"}, {**timed, "cross_entropy": {"plain": None, "fused": {}}}, {},
                    {"gpu": H100, "cross_entropy": "nonsense"}):
        assert cross_entropy.choose(auto, H100, unknown) == ("plain", f"auto: plain, --check has not timed both "
                                                                      f"losses on this {H100}")
    assert cross_entropy.choose(auto, "cpu", timed)[0] == "plain"


def test_the_chunk_is_torchs_aspect_ratio_2():
    """torch's own pick for bf16 on CUDA ('aspect_ratio:2'), which the planner prices: 256 tokens of 8 x 1024 at
    width 2048 and GPT-2's padded vocabulary."""
    options = torch.nn.LinearCrossEntropyOptions(chunking_method="aspect_ratio:2")
    for tokens, width, vocab in ((8192, 2048, 50304), (16384, 2048, 50304), (64, 16, 256), (3, 16, 256), (100, 8, 7)):
        assert cross_entropy.chunk_rows(tokens, width, vocab) == options._adjust(tokens, width, vocab,
                                                                                 torch.float32).batch_chunk_size
    assert cross_entropy.chunk_rows(8192, 2048, 50304) == 256


@pytest.mark.slow
@pytest.mark.parametrize("parallel, precisions", [("ddp", ["fp32"]), ("fsdp", ["fp32", "bf16"])])
def test_ddp_and_fsdp_give_the_fused_loss_the_plain_ones_gradients_compiled_whole_or_not(tmp_path, parallel,
                                                                                        precisions):
    """One 2-process gloo job (tests/support/loss_probe.py) per wrapping: under FSDP2 the head's weight is gathered whole (and
    in bf16 with --dtype bf16) for the root's forward, so torch's op sees a plain tensor. fp32: the gradients' largest
    difference relative to each tensor's largest value, measured 1.4e-5 (mHC's gates, sums of cancelling terms); bf16:
    the loss, measured 3e-4 (DDP) and 8e-4 (FSDP) from plain's, the bf16 rounding of each token's loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    for precision in precisions:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(ROOT / "tests" / "support" / "loss_probe.py"), parallel, precision], capture_output=True,
                              text=True, timeout=600, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        worst = json.loads(done.stdout.strip().splitlines()[-1])
        assert worst.keys() == {"plain/eager", "plain/model", "fused/eager", "fused/model"}
        for variant, found in worst.items():
            assert found["graph_breaks"] == 0 and found["parameters"] == 48, worst
            assert found["loss"] < (1e-6 if precision == "fp32" else 5e-3), (variant, worst)
            if precision == "fp32":
                assert found["grad"] < 1e-4, (variant, worst)


@pytest.mark.slow
def test_a_run_with_the_fused_loss_trains_as_the_plain_one_and_says_which_it_took(tmp_path):
    """Six steps through the command line each way: the same losses to 1e-5 (measured 2e-7), and config.json and
    train.log say which loss ran and why."""
    runs = {loss: subprocess.Popen(
        [sys.executable, str(ROOT / "train_c4.py"), "--preset", "tiny", "--residual", "mhc", "--steps", "6",
         "--cross-entropy", loss, "--out", str(tmp_path), "--run-name", loss],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path) for loss in ("plain", "fused")}
    losses = {}
    for loss, process in runs.items():
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        config = json.loads((tmp_path / loss / "config.json").read_text())
        assert (config["cross_entropy"], config["cross_entropy_reason"]) == (loss, f"--cross-entropy {loss}")
        assert f"cross-entropy: {loss} (--cross-entropy {loss})" in (tmp_path / loss / "train.log").read_text()
        losses[loss] = [json.loads(line)["loss"] for line in (tmp_path / loss / "metrics.jsonl").read_text().splitlines()
                        if "loss" in json.loads(line)]
    assert len(losses["fused"]) == 6 and losses["fused"] == pytest.approx(losses["plain"], rel=1e-5)
