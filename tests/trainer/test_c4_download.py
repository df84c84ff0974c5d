"""hcstudy/c4_download.py (setup.sh --prefetch-c4): a hub out of reach said in one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hcstudy import c4_download


ROOT = Path(__file__).resolve().parents[2]


def test_prefetch_says_the_hub_cannot_be_reached(tmp_path):
    """setup.sh --prefetch-c4 runs hcstudy.c4_download: with the hub out of reach (here HF_HUB_OFFLINE) one line says
    so, not huggingface_hub's LocalEntryNotFoundError."""
    result = subprocess.run([sys.executable, "-m", "hcstudy.c4_download", "1", str(tmp_path)], capture_output=True,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120, cwd=ROOT)
    assert result.returncode != 0 and "LocalEntryNotFoundError" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("setup.sh: the Hugging Face hub cannot be reached (")


def test_prefetch_names_a_failed_name_lookup_as_the_hub_unreachable(tmp_path, monkeypatch):
    import huggingface_hub

    def no_name_server(*args, **kwargs):
        raise RuntimeError("HEAD failed") from OSError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_name_server)
    with pytest.raises(SystemExit, match="hub cannot be reached .*the 0 file"):
        c4_download.download_c4(1, str(tmp_path))
