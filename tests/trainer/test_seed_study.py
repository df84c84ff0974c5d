"""The seed-study preset the study's arms bring (the public study's body and recipe: its data, vocabulary, warm-up,
optimizer, the training reading): each difference from ours a setting that turns back. The arms' own formulas are
held to the study's layer in tests/arms/test_study_hc.py and test_study_mhc.py."""
import json
import math
import types

import pytest
import torch

from hcstudy import arms, optim
from hcstudy import contract
import train_c4 as T
from hcstudy.arms import hc, mhc
from hcstudy.arms import study_hc as study_hc_arm, study_mhc as study_mhc_arm
from hcstudy.config import PRESETS, parse_config
from hcstudy.data import ByteTokenizer, GPT2Tokenizer, TokenWindows
from hcstudy.distributed import Dist, unwrap
from hcstudy.model import GPT, MLP, PreNorm, padded_vocab_size
from hcstudy.optim import lr_at, make_optimizer

from helpers import tiny_config
from study_layer import N, WIDTH, study_config


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


def test_the_study_arms_bring_the_study_preset_and_name_their_runs_as_the_launcher_does():
    cfg = parse_config(["--residual", "study-hc", "--depth", "32"])
    assert (cfg.preset, cfg.coefficients, cfg.dynamic_init_std, cfg.read_stream, cfg.collapse) == (
        "seed-study", "sequence", 0.02, "first", "first")
    assert cfg.run_name == contract.run_name("study-hc", 32, 42) == "study-hc_d32_s42"
    token = parse_config(["--residual", "study-mhc", "--coefficients", "token"])
    assert token.run_name == contract.run_name("study-mhc", 32, 42, None, 20, "token") == "study-mhc_d32_s42_tok"
    small = parse_config(["--residual", "study-mhc", "--preset", "demo"])      # a preset given wins over the arm's
    assert (small.preset, small.depth, small.mhc_res_diag) == ("seed-study,demo", 4, 2.0)
    # the paper's HC in the study's body and recipe is named after them
    paper = parse_config(["--preset", "seed-study", "--residual", "hc", "--depth", "32"])
    assert paper.run_name == contract.run_name("hc", 32, 42, "seed-study") == "hc_d32_s42_seed-study"
    default = parse_config([])                      # the papers' model stays the default
    assert (default.preset, default.coefficients, default.dynamic_init_std, default.read_stream,
            default.collapse) == ("c4", "token", 0.0, "rotate", "sum")
    assert parse_config(["--residual", "mhc", "--sinkhorn-iters", "100"]).run_name == "mhc_d32_s42_it100"


def test_each_seed_study_choice_shapes_the_model():
    study = dict(read_stream="first", dynamic_init_std=0.01)
    torch.manual_seed(0)
    study_hc = GPT(tiny_config("hc", depth=2, **study))
    assert all(conn.A_m_static.argmax() == 0 for block in study_hc.blocks for conn in (block.attn_conn, block.mlp_conn))
    assert 0.005 < study_hc.blocks[0].attn_conn.dynamic.weight.std() < 0.02
    study_mhc = mhc.Connection(tiny_config("mhc", **study), 3)
    assert study_mhc.b_pre.argmax() == 0
    # the study's HC: one RMS for the whole state, so scaling one stream changes the coefficients of the others
    x = torch.randn(2, 4, 4, 16)
    louder = x.clone()
    louder[..., 1, :] *= 10
    flat = study_hc_arm.Connection(tiny_config("study-hc"), 0)
    per_stream = hc.Connection(tiny_config("hc"), 0)
    for conn in (flat, per_stream):
        torch.nn.init.normal_(conn.dynamic.weight)
    moved = [(conn.coefficients(louder)[0] - conn.coefficients(x)[0])[..., 0].abs().max()     # stream 0's read
             for conn in (flat, per_stream)]
    assert moved[0] > 1e-4 and moved[1] == 0
    # the study's mHC's tanh: the read weights stay within sigmoid(+-a_pre + b_pre) however large the projection
    tanh = study_mhc_arm.Connection(tiny_config("study-mhc", mhc_gate_init=1.0, mhc_pre_bias=-4.0), 0)
    torch.nn.init.normal_(tanh.phi.weight, std=1e3)
    H_pre = tanh.coefficients(x)[0]
    assert H_pre[..., 0].max() <= torch.sigmoid(torch.tensor(1.0 - 4.0)) + 1e-6
