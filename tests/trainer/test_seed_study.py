"""The study's arms (study-hc, study-mhc, with the seed-study preset they bring) against the public study's HC and
mHC, rebuilt here from its choices as docs/model.md's table lists them ("The public study's model"): separate
Linears of the flattened state, tanh, the study's biases and Sinkhorn, an RMSNorm with a learnable scale. Our code
and this one get the same weights and must agree in fp64."""
import json
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hcstudy import arms, optim
from hcstudy import contract
from hcstudy.kernels import choice
import train_c4 as T
from hcstudy.arms import hc
from hcstudy.config import PRESETS, parse_config
from hcstudy.contract import ConfigError
from hcstudy.data import ByteTokenizer, GPT2Tokenizer, TokenWindows
from hcstudy.distributed import Dist, unwrap
from hcstudy.model import GPT, MLP, PreNorm, kernel_path, padded_vocab_size
from hcstudy.optim import lr_at, make_optimizer

N, WIDTH, ITERS = 4, 16, 20


def study_config(residual, *flags):
    return parse_config(["--preset", "tiny,seed-study", "--residual", residual, "--expansion", str(N), *flags])


class StudyRMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), 1e-8

    def forward(self, v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def study_sinkhorn(logits):
    P = torch.exp(logits)
    for _ in range(ITERS):
        P = P / (P.sum(-1, keepdim=True) + 1e-8)
        P = P / (P.sum(-2, keepdim=True) + 1e-8)
    return P


class StudyConnection(nn.Module):
    """The study's HC (mhc=False) or mHC on streams x (B, T, n, C): coefficients from the streams pooled over the
    sequence and flattened, then x_next = H_res x + H_post^T F(H_pre x)."""

    def __init__(self, mhc):
        super().__init__()
        self.mhc, stream0 = mhc, torch.eye(N)[0]
        self.norm = StudyRMSNorm(N * WIDTH)
        self.theta_pre, self.theta_post = nn.Linear(N * WIDTH, N, bias=False), nn.Linear(N * WIDTH, N, bias=False)
        self.theta_res = nn.Linear(N * WIDTH, N * N, bias=False)
        self.alpha_pre, self.alpha_post, self.alpha_res = (nn.Parameter(torch.tensor(0.01)) for _ in range(3))
        scale = 2.0 if mhc else 1.0         # mHC: b_pre[0] = b_post[0] = 2, b_res = 2 I; HC: 1, 1, I
        self.b_pre, self.b_post = nn.Parameter(scale * stream0), nn.Parameter(scale * stream0)
        self.b_res = nn.Parameter(scale * torch.eye(N))

    def forward(self, x, sublayer):
        v = self.norm(x.mean(1).flatten(-2))                                   # (B, nC)
        pre, post, res = (torch.tanh(theta(v)) for theta in (self.theta_pre, self.theta_post, self.theta_res))
        res = res.view(-1, N, N)
        if self.mhc:
            H_pre = torch.sigmoid(self.alpha_pre * pre + self.b_pre)
            H_post = 2 * torch.sigmoid(self.alpha_post * post + self.b_post)
            H_res = study_sinkhorn(self.alpha_res * res + self.b_res)
        else:
            H_pre, H_post = self.alpha_pre * pre + self.b_pre, self.alpha_post * post + self.b_post
            H_res = self.alpha_res * res + self.b_res
        y = sublayer(torch.einsum("bn,btnc->btc", H_pre, x))
        return torch.einsum("bij,btjc->btic", H_res, x) + H_post[:, None, :, None] * y[:, :, None, :]


def counterparts(ours, study):
    """(our parameter, the study's parameter or parameters it holds): the three Linears are the blocks of one."""
    weight = [study.theta_pre.weight, study.theta_post.weight, study.theta_res.weight]
    pairs = [(ours.norm_scale, study.norm.weight)]
    if study.mhc:
        pairs += [(ours.phi.weight, weight), (ours.a_pre, study.alpha_pre), (ours.a_post, study.alpha_post),
                  (ours.a_res, study.alpha_res), (ours.b_pre, study.b_pre), (ours.b_post, study.b_post),
                  (ours.b_res, study.b_res)]
    else:
        pairs += [(ours.dynamic.weight, weight), (ours.s_a, study.alpha_pre), (ours.s_b, study.alpha_post),
                  (ours.s_r, study.alpha_res), (ours.A_m_static, study.b_pre), (ours.B_static, study.b_post),
                  (ours.A_r_static, study.b_res)]
    return pairs


def flat(theirs, grad=False):
    """The study's parameter(s), or their gradients, as one flat tensor in our layout."""
    return torch.cat([(p.grad if grad else p).detach().reshape(-1) for p in
                      (theirs if isinstance(theirs, list) else [theirs])])


def copy_into(ours, study):
    with torch.no_grad():
        for mine, theirs in counterparts(ours, study):
            mine.copy_(flat(theirs).view_as(mine))


@pytest.mark.parametrize("residual", ["study-hc", "study-mhc"])
def test_the_study_arms_start_where_the_study_starts(residual):
    """At init our connection's biases are the study's (mHC's H_res diagonal 0.711, H_pre 0.88 / 0.5, H_post 1.76 /
    1; HC writes stream 0 only)."""
    cfg = study_config(residual)
    ours, study = arms.connection(residual)(cfg, 5), StudyConnection(residual == "study-mhc")
    for mine, theirs in counterparts(ours, study)[2:]:
        assert torch.equal(mine.detach().reshape(-1), flat(theirs))     # the biases and the scales 0.01
    if residual == "study-mhc":
        H_pre, H_post, H_res, _ = ours.coefficients(torch.zeros(1, 1, N, WIDTH))
        assert H_res[0, 0, 0, 0].item() == pytest.approx(math.e ** 2 / (math.e ** 2 + 3), abs=1e-6)
        assert H_pre[0, 0].tolist() == pytest.approx([0.8808, 0.5, 0.5, 0.5], abs=1e-4)
        assert H_post[0, 0].tolist() == pytest.approx([1.7616, 1, 1, 1], abs=1e-4)


@pytest.mark.parametrize("residual", ["study-hc", "study-mhc"])
def test_the_study_arms_equal_the_studys_layer_in_fp64(residual):
    """Random weights far from init, copied in: the same output and the same gradients, to 1e-10."""
    cfg = study_config(residual)
    torch.manual_seed(0)
    ours, study = arms.connection(residual)(cfg, 3).double(), StudyConnection(residual == "study-mhc").double()
    with torch.no_grad():
        for p in study.parameters():
            p.copy_(p + 0.5 * torch.randn_like(p))
    copy_into(ours, study)
    pairs = counterparts(ours, study)
    sublayer = PreNorm(cfg, MLP(cfg)).double()
    x = torch.randn(3, 8, N, WIDTH, dtype=torch.float64)
    x_ours, x_study = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, _ = ours(x_ours, sublayer)
    out_study = study(x_study, sublayer)
    assert (out_ours - out_study).abs().max() < 1e-10
    assert (out_ours - x).abs().max() > 0.1                # the streams really are mixed and written
    target = torch.randn_like(x)
    (out_ours * target).sum().backward()
    ours_grads = [mine.grad.clone().reshape(-1) for mine, _ in pairs]
    sublayer.zero_grad()
    (out_study * target).sum().backward()
    assert (x_ours.grad - x_study.grad).abs().max() < 1e-10
    for (mine, theirs), grad in zip(pairs, ours_grads):
        assert (grad - flat(theirs, grad=True)).abs().max() < 1e-10


# --- the preset: the study's recipe, each difference a setting to turn back ----------------------------------

def test_the_memory_check_plans_the_vocabulary_the_model_builds(monkeypatch, tmp_path):
    planned = []
    monkeypatch.setattr(T.memory, "check_memory", lambda cfg, vocab, *rest: planned.append(vocab))
    for vocab in ("exact", "padded"):
        cfg = parse_config(["--preset", "tiny", "--tokenizer", "gpt2", "--vocab", vocab, "--out", str(tmp_path)])
        T.preflight(cfg, Dist(0, 1, torch.device("cpu")))
    assert planned == [50257, 50304]


def test_each_difference_of_the_body_is_a_setting_that_turns_back_to_ours():
    study, ours = study_config("study-hc"), parse_config(["--preset", "tiny", "--residual", "hc"])
    assert (study.batch_size, study.steps, study.vocab) == (8, 5000, "exact")
    assert padded_vocab_size("gpt2", study.vocab == "exact") == 50257
    for key, value in contract.SEED_STUDY_MODEL.items():
        assert getattr(study, key) == value != getattr(ours, key), key
        arm = "study-hc" if "study-hc" in contract.ARMS_OF.get(key, ("study-hc",)) else "study-mhc"
        assert getattr(study_config(arm, f"--{key.replace('_', '-')}", str(getattr(ours, key))), key) == \
            getattr(ours, key), key
    # what the arms do differently is their formulas, not settings: the study's HC writes stream 0 only
    assert torch.equal(arms.connection("study-hc")(study, 0).B_static.detach(), torch.eye(N)[0])
    assert torch.equal(hc.Connection(study_config("hc"), 0).B_static.detach(), torch.ones(N))


def test_the_study_model_is_trained_as_the_study_trains_it():
    """Output projections and dynamic weights at 0.02 (the study's re-draw), weight decay on every parameter."""
    cfg = dataclasses_replace(study_config("study-hc"), depth=8, width=64, heads=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert 0.017 < model.blocks[0].mlp.inner.proj.weight.std() < 0.023
    assert 0.017 < model.blocks[0].attn_conn.dynamic.weight.std() < 0.023
    decayed = make_optimizer(model, cfg).param_groups[0]["params"]
    assert len(decayed) == len(list(model.parameters()))
    turned_back = dataclasses_replace(cfg, proj_init="scaled", weight_decay_on="matrices")
    ours = GPT(turned_back)
    assert ours.blocks[0].mlp.inner.proj.weight.std() < 0.006
    assert len(make_optimizer(ours, turned_back).param_groups[0]["params"]) < len(decayed)


def test_the_kernels_refuse_the_studys_variants_and_auto_takes_the_formulas():
    for path in ("fused", "triton"):
        with pytest.raises(ConfigError, match=f"--kernels {path} has the papers' streams only"):
            study_config("study-mhc", "--kernels", path)
        with pytest.raises(ConfigError, match=f"--kernels {path} has .* not the study's --mixing-norm"):
            parse_config(["--residual", "mhc", "--kernels", path, "--mixing-norm", "scaled"])
        assert not choice.supports(study_config("mhc"), path)           # the paper's mHC in the study's body
    for residual in ("study-hc", "study-mhc"):
        assert kernel_path(study_config(residual), torch.device("cpu"))[0] == "reference"


def dataclasses_replace(cfg, **changes):
    return T.dataclasses.replace(cfg, **changes)


def test_the_studys_warm_up_starts_at_lr_zero_and_reaches_lr_one_step_later():
    lrs = {start: [lr_at(parse_config(["--lr", "8", "--warmup", "4", "--warmup-from", start]), step)
                   for step in range(5)] for start in ("one-step", "zero")}
    assert lrs == {"one-step": [2.0, 4.0, 6.0, 8.0, 8.0], "zero": [0.0, 2.0, 4.0, 6.0, 8.0]}
    assert parse_config([]).warmup_from == "one-step"


class Documents(list):
    """A document stream held in memory, with what TokenWindows reads of DocumentStream's state."""
    skipped = 0

    def state_dict(self):
        return {}


@pytest.mark.parametrize("separator, expected", [
    ("eot", [[104, 105, 0, 97], [98, 99, 0, 100], [0, 104, 105, 0]]),
    ("none", [[104, 105, 97, 98], [99, 100, 104, 105], [97, 98, 99, 100]]),
])
def test_the_study_joins_documents_with_no_separator(separator, expected):
    documents = Documents(["hi", "abc", "d"] * 2)                   # "hi" is bytes 104 105, "abc" 97 98 99, "d" 100
    windows = TokenWindows(documents, ByteTokenizer(), seq_len=3, separator=separator).take(3)
    assert windows.tolist() == expected
    gpt2 = TokenWindows(Documents(["hello world", "hello"]), GPT2Tokenizer(), seq_len=2, separator=separator)
    assert gpt2.take(1).tolist() == [[31373, 995, 50256] if separator == "eot" else [31373, 995, 31373]]


def test_a_run_without_separators_trains_and_evaluates_on_joined_documents(tmp_path):
    """The bundled documents never hold byte 0: with separator none, neither do the training or held-out windows
    of a trainer (a few documents' worth each: about 6 kB a document)."""
    for separator in ("eot", "none"):
        cfg = parse_config(["--preset", "tiny", "--seq-len", "2048", "--doc-separator", separator, "--out",
                              str(tmp_path), "--run-name", separator, "--wandb", "disabled"])
        trainer = T.build_trainer(cfg, Dist(0, 1, torch.device("cpu")))
        try:
            training = torch.cat([trainer.loader.next_batch()[0] for _ in range(5)])
        finally:
            trainer.loader.close()
        assert [bool((windows == 0).any()) for windows in (training, trainer.val[0])] == [separator == "eot"] * 2


def test_under_bf16_autocast_the_studys_norm_first_order_gives_its_coefficients_to_the_bit():
    """The study divides vec(x) by its RMS before its bf16 projections, so that z, tanh(z) and a * z stay bf16:
    the study's mHC does so and equals its coefficients to the bit; the paper's order (ours, dividing the
    projection's output, as the kernels fuse it) gives z in fp32 and other roundings."""
    x = torch.randn(3, 1, N, WIDTH)
    torch.manual_seed(0)
    study = StudyConnection(True)
    with torch.no_grad():
        for p in study.parameters():
            p.add_(0.5 * torch.randn_like(p))
        v = study.norm(x.flatten(-2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        pre, post, res = (torch.tanh(theta(v)) for theta in (study.theta_pre, study.theta_post, study.theta_res))
        H_study = (torch.sigmoid(study.alpha_pre * pre + study.b_pre),
                   2 * torch.sigmoid(study.alpha_post * post + study.b_post),
                   study_sinkhorn(study.alpha_res * res.unflatten(-1, (N, N)) + study.b_res))
    ours = arms.connection("study-mhc")(study_config("study-mhc"), 3)
    copy_into(ours, study)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        H_ours = ours.coefficients(x)[:3]
        # the paper's order on the same weights, with the study's tanh added after it
        inv_rms = torch.rsqrt(x.flatten(-2).square().mean(-1, keepdim=True) + ours.eps)
        z = torch.tanh(F.linear(ours.scaled(x).flatten(-2), ours.phi.weight) * inv_rms)
    differences = [max((mine - theirs).abs().max().item() for mine, theirs in zip(H_ours, H_study)),
                   (z - torch.tanh(v @ torch.cat([study.theta_pre.weight, study.theta_post.weight,
                                                  study.theta_res.weight]).T)).abs().max().item()]
    assert differences[0] == 0 and differences[1] > 1e-4


def test_the_studys_shuffle_buffer_is_set_and_a_presets_own_data_keeps_its_own():
    """10,000 documents a stream over C4; the demo's 64 stays where the demo chose the data, in either order."""
    buffer = {preset: parse_config(["--preset", preset]).shuffle_buffer
              for preset in ("c4", "seed-study", "seed-study,stress", "demo,seed-study", "seed-study,demo", "tiny")}
    assert buffer == {"c4": 1024, "seed-study": 10_000, "seed-study,stress": 10_000, "demo,seed-study": 64,
                      "seed-study,demo": 64, "tiny": 64}
    assert parse_config(["--preset", "demo,seed-study", "--shuffle-buffer", "10000"]).shuffle_buffer == 10_000
    turned_back = parse_config(["--preset", "seed-study", "--residual", "hc", "--shuffle-buffer", "1024"])
    assert (turned_back.shuffle_buffer, turned_back.run_name) == (1024, "hc_d32_s42_seed-study")   # a size, as --steps


# --- presets compose, and a run is named after its settings --------------------------------------------------

def test_presets_compose_in_order_with_explicit_flags_last():
    listed = parse_config(["--preset", "demo,seed-study", "--residual", "hc", "--steps", "3"])
    repeated = parse_config(["--preset", "demo", "--preset", "seed-study", "--residual", "hc", "--steps", "3"])
    assert listed == repeated and listed.preset == "demo,seed-study"
    assert (listed.width, listed.data, listed.batch_size, listed.steps, listed.read_stream) == (
        128, "sample", 8, 3, "first")
    assert parse_config(["--preset", "seed-study,demo"]).batch_size == 16       # the later preset wins


@pytest.mark.parametrize("argv, message", [
    (["--preset", "demo,nonsense"], "--preset: invalid choice: 'nonsense'"),
    (["--preset", "demo,c4"], "--preset demo,c4: c4 is the defaults and combines with no other"),
    (["--preset", "demo,odd-batch"], "--preset demo,odd-batch cannot compose: --batch-size 12 is not divisible by "
                                     "--micro-batch-size 16"),
])
def test_presets_that_cannot_compose_are_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    monkeypatch.setitem(PRESETS, "odd-batch", {"batch_size": 12})
    assert T.main(argv) == contract.EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_run_is_named_after_its_settings_however_they_were_asked():
    by_flags = ["--coefficients", "sequence"] + [       # the study's settings that HC has (others are refused)
        arg for key, value in contract.SEED_STUDY_MODEL.items() if "hc" in contract.ARMS_OF.get(key, ("hc",))
        for arg in [f"--{key.replace('_', '-')}", str(value)]]
    for argv in (["--preset", "seed-study"], ["--preset", "demo,seed-study", "--depth", "32"], by_flags):
        assert parse_config([*argv, "--residual", "hc"]).run_name == "hc_d32_s42_seed-study", argv
    assert parse_config(["--preset", "seed-study", "--preset", "stress", "--residual", "hc"]).run_name == \
        "hc_d32_s42_seed-study-stress"
    assert parse_config(["--residual", "hc", "--depth", "48", "--seed", "123"]).run_name == "hc_d48_s123"
    assert parse_config(["--preset", "stress", "--residual", "mhc"]).run_name == "mhc_d32_s42_stress"
    # the study's arms: their name says the preset, given or not
    for argv in ([], ["--preset", "seed-study"], ["--preset", "demo", "--depth", "32"]):
        assert parse_config([*argv, "--residual", "study-mhc"]).run_name == "study-mhc_d32_s42", argv
    assert parse_config(["--preset", "stress", "--residual", "study-hc"]).run_name == "study-hc_d32_s42_stress"
    # one setting turned back: no longer the study's body, so not named after it
    for residual, back in (("hc", ["--warmup-from", "one-step"]), ("mhc", ["--doc-separator", "eot"]),
                           ("mhc", ["--mhc-post-bias", "0"]), ("hc", ["--read-stream", "rotate"])):
        assert parse_config(["--preset", "seed-study", "--residual", residual, *back]).run_name == \
            f"{residual}_d32_s42_seq", back


# --- the study's reading on its own scope: the training batch, every step, full depth ---------------------------

def study_reading(H_means):
    """The study's full-depth reading of per-sublayer batch means: H_1 ... H_L, max of abs row and column sums."""
    Q = H_means[0]
    for H in H_means[1:]:
        Q = Q @ H
    return max(Q.abs().sum(-1).max().item(), Q.abs().sum(-2).max().item())


@pytest.mark.parametrize("residual", ["study-hc", "study-mhc"])
def test_the_study_reading_comes_from_the_training_forwards_of_the_whole_batch(residual, tmp_path):
    """Four micro-batches of two: the batch mean of each H_res from the forwards that trained, one forward each."""
    cfg = study_config(residual, "--micro-batch-size", "2", "--out", str(tmp_path), "--wandb", "disabled")
    trainer = T.build_trainer(cfg, Dist(0, 1, torch.device("cpu")))
    model, batches, forwards = unwrap(trainer.model), [], []
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():       # far from init, so that the streams really mix
                if "_conn." in name:
                    p.add_(0.3 * torch.randn_like(p))
        next_batch = trainer.loader.next_batch
        trainer.loader.next_batch = lambda: batches.append(next_batch()) or batches[-1]
        model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        loss, stop, reading = optim.accumulate(trainer.model, trainer.loader, trainer.accum, trainer.dist, trainer.dtype,
                                               types.SimpleNamespace(requested=False)).tolist()
    finally:
        trainer.loader.close()
    assert len(batches) == len(forwards) == 4 and stop == 0
    with torch.no_grad():
        means = 0
        for x, _ in batches:
            records = []
            model(x, mixing_out=records)
            means = means + torch.stack([H.double().reshape(-1, N, N).mean(0) for H, _ in records]) / len(batches)
    assert reading == pytest.approx(study_reading(means), rel=1e-6)
    assert abs(reading - 1) > 1e-3 if residual == "study-hc" else abs(reading - 1) < 1e-5     # mHC: doubly stochastic


def test_every_training_step_logs_the_study_reading_and_the_baseline_logs_one(tmp_path):
    for residual in ("baseline", "study-hc"):
        code = T.main(["--preset", "tiny,seed-study", "--residual", residual, "--steps", "3", "--out", str(tmp_path),
                       "--wandb", "disabled"])
        assert code == 0
    for name, exactly_one in (("baseline_d2_s42_seed-study", True), ("study-hc_d2_s42", False)):
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        readings = [line[contract.STUDY_TRAIN_KEY] for line in lines if line["step"] > 0 and "loss" in line]
        assert len(readings) == 3 and all(math.isfinite(r) for r in readings)
        assert (readings == [1.0] * 3) == exactly_one
        assert [line["lr"] for line in lines if "loss" in line][:2] == [0.0, 1.5e-3]    # the study's warm-up: 0, lr/2


@pytest.mark.parametrize("residual", ["study-hc", "study-mhc"])
def test_mixing_precision_autocast_mixes_under_the_runs_bf16_and_keeps_fp32_streams(residual):
    torch.manual_seed(0)
    x = torch.randn(2, 8, N, WIDTH)
    outputs = {}
    for precision in ("fp32", "autocast"):
        cfg = study_config(residual, "--mixing-precision", precision)
        torch.manual_seed(1)
        conn, sublayer = arms.connection(residual)(cfg, 0), PreNorm(cfg, MLP(cfg))
        with torch.no_grad():
            for p in conn.parameters():
                p.add_(0.3 * torch.randn_like(p))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outputs[precision] = conn(x, sublayer)[0]
        assert outputs[precision].dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        plain = conn.coefficients(x.mean(1, keepdim=True))[2]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        rounded = conn.coefficients(x.mean(1, keepdim=True))[2]
    assert (plain - rounded).abs().max() > 1e-4          # the coefficients were computed in bf16
    assert (outputs["fp32"] - outputs["autocast"]).abs().max() > 1e-4
