"""Every test runs offline: no hub, no W&B, a throw-away Hugging Face cache; and leaves nothing in TMPDIR beyond
pytest's own folder."""
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# importing torch creates its compile cache, TMPDIR/torchinductor_USER, unless told where (the tests' subprocesses
# inherit this): the suite keeps it in pytest's cache folder, warm from one run to the next. Inductor's precompiled
# C++ headers go to TMPDIR/torchinductor_USER whatever the cache's place: not precompiled here (about 5 s more on a
# cold cache for the one fast test that compiles with inductor, none on a warm one)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".pytest_cache" / "torchinductor"))
os.environ.setdefault("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0")

import torch  # noqa: E402  (after the cache's place is set)

# tiny models gain nothing from a second thread, and OpenMP threads spinning on a shared 2-core
# machine made a 60-step run take 70 s instead of 8 s
torch.set_num_threads(1)

# the repository (train_c4, hcstudy), this folder, and support/ (the fakes, probes and helpers the test files share)
# for every test folder
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent / "support")]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a real scenario of several runs or processes (over about 8 s on a 2-core CPU); "
                            "`-m 'not slow'` skips them")


@pytest.fixture(autouse=True, scope="session")
def torchrun_logs_in_pytests_folder(tmp_path_factory):
    """torchrun's agent makes a torchelastic_* folder in TMPDIR at every start and never removes it (torchrun.py
    removes its own): the tests' torch.distributed.run commands put theirs in pytest's folder (PET_LOG_DIR is
    torchrun's --log-dir). Session-wide, so that module-scoped runs have it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PET_LOG_DIR", str(tmp_path_factory.getbasetemp() / "torchelastic"))
        yield


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home"))
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tiktoken"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # what the tests' processes put in a temporary folder stays in pytest's own: a trainer killed on purpose cannot
    # remove its multiprocessing folder (pymp-*), nor a worker that pytest-xdist ends without its exit handlers
    scratch = tmp_path_factory.getbasetemp() / "tmp"
    scratch.mkdir(exist_ok=True)
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
