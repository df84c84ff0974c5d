"""hcstudy/data.py: disjoint virtual streams, the held-out set, hub failures and their retries."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_c4 as T
from hcstudy.config import parse_config
from hcstudy.contract import ConfigError, DataUnavailable
from hcstudy.data import ByteTokenizer, DocumentStream, RankBatches, in_held_out_slice, resolve_data_files

from data_shards import write_shards


ROOT = Path(__file__).resolve().parents[2]


def one_epoch(stream):
    documents = []
    for text in stream:
        documents.append(text.split()[0])
        if stream.epoch > 0:
            break
    return documents[:-1] + stream.buffer                    # what was yielded, plus what the buffer holds


@pytest.mark.parametrize("shards", [4, 3])                  # whole shards per stream, or every 4th line
def test_streams_read_disjoint_documents_whose_union_is_everything(tmp_path, shards):
    files = write_shards(tmp_path, shards=shards)
    per_stream = [one_epoch(DocumentStream(files, rank=v, world=4, seed=3, buffer_size=5)) for v in range(4)]
    everything = [d for stream in per_stream for d in stream]
    assert len(everything) == len(set(everything)) == shards * 30


def test_hub_errors_are_retried_with_backoff_from_the_saved_position(tmp_path, monkeypatch):
    files = write_shards(tmp_path, shards=1)
    stream = DocumentStream(files, rank=0, world=1, seed=None, buffer_size=0)
    stream.remote = True
    opened, delays = [], []
    real_open = stream._open_epoch

    def flaky_open():
        opened.append(stream.position)
        if len(opened) in (2, 3):
            raise ConnectionError("429 Too Many Requests")
        return real_open()

    monkeypatch.setattr(stream, "_open_epoch", flaky_open)
    monkeypatch.setattr(T.time, "sleep", delays.append)
    first = [text for _, text in zip(range(10), stream)]
    assert len(opened) == 1
    # the connection drops: the next read reopens twice in vain (429), then continues where it stopped
    documents = iter(stream)
    rest = [next(documents) for _ in range(20)]
    assert [d.split()[0] for d in first + rest] == [f"doc-0-{i}" for i in range(30)]
    assert len(delays) == 2 and 1 <= delays[0] <= 3 and 2 <= delays[1] <= 6   # 2^k s with +-50 % jitter


def test_hub_gives_up_with_exit_6_after_the_retries(tmp_path, monkeypatch):
    stream = DocumentStream(write_shards(tmp_path, shards=1), rank=0, world=1, seed=None, buffer_size=0)
    stream.remote = True
    monkeypatch.setattr(stream, "_open_epoch", lambda: (_ for _ in ()).throw(TimeoutError("read timed out")))
    monkeypatch.setattr(T.time, "sleep", lambda seconds: None)
    with pytest.raises(DataUnavailable, match="after 7 attempt"):
        next(iter(stream))


def test_a_failed_name_lookup_is_not_retried(tmp_path, monkeypatch):
    """No name server for the hub is no rate limit: exit 6 at once, not after two minutes of retries."""
    stream = DocumentStream(write_shards(tmp_path, shards=1), rank=0, world=1, seed=None, buffer_size=0)
    stream.remote = True
    lookup = OSError("[Errno -2] Name or service not known")
    refused = ConnectionError("HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded")
    refused.__cause__ = lookup
    monkeypatch.setattr(stream, "_open_epoch", lambda: (_ for _ in ()).throw(refused))
    delays = []
    monkeypatch.setattr(T.time, "sleep", delays.append)
    with pytest.raises(DataUnavailable, match=r"^the hub cannot be reached \(ConnectionError: .*--prefetch-c4"):
        next(iter(stream))
    assert delays == []


@pytest.mark.slow
@pytest.mark.parametrize("variable", ["HF_HOME", "HF_DATASETS_CACHE"])
def test_local_files_are_read_without_a_writable_hugging_face_cache(variable):
    """The bundled sample needs no cache: an unwritable HF_HOME or HF_DATASETS_CACHE does not stop it."""
    read = ("from hcstudy.data import DocumentStream, resolve_data_files; files = resolve_data_files('sample').train; "
            "stream = DocumentStream(files, rank=0, world=1, seed=None, buffer_size=0); print(next(iter(stream))[:20])")
    result = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            env={**os.environ, variable: "/proc/nope"})
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]


def test_an_unwritable_hugging_face_cache_is_named_as_the_cause_for_the_hub(tmp_path, monkeypatch):
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path("/proc/nope/datasets"))
    stream = DocumentStream(write_shards(tmp_path, shards=1), rank=0, world=1, seed=None, buffer_size=0)
    stream.remote = True
    refused = FileNotFoundError(2, "No such file or directory", "/proc/nope")
    monkeypatch.setattr(stream, "_open_epoch", lambda: (_ for _ in ()).throw(refused))
    monkeypatch.setattr(T.time, "sleep", lambda seconds: pytest.fail("a cache that cannot be written is not retried"))
    with pytest.raises(ConfigError, match=r"Hugging Face cache cannot be written .*/proc/nope.*HF_HOME"):
        next(iter(stream))


def test_the_hub_unreachable_at_the_start_leaves_failed_with_the_reason(tmp_path, monkeypatch, capsys):
    def unreachable(*args):
        raise DataUnavailable("the hub cannot be reached (ConnectionError: ...)")

    monkeypatch.setattr(T, "fixed_sequences", unreachable)
    assert T.main(["--preset", "tiny", "--out", str(tmp_path), "--run-name", "r"]) == 6
    assert capsys.readouterr().err.strip().splitlines() == ["error: the hub cannot be reached (ConnectionError: ...)"]
    status = json.loads((tmp_path / "r" / "status.json").read_text())
    assert (status["state"], status["exit_code"], status["step"]) == ("failed", 6, 0)
    assert status["reason"].startswith("the hub cannot be reached")


def test_offline_hub_fails_fast_with_exit_6_and_a_way_out(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    started = time.time()
    result = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), "--data", "c4", "--tokenizer", "byte",
                             "--preset", "tiny", "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == 6
    assert "--prefetch-c4" in result.stderr and "local glob" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and time.time() - started < 60


def test_validation_set_is_fixed_whatever_the_model_seed():
    data = resolve_data_files("sample")
    first = T.fixed_sequences(data, ByteTokenizer(), seq_len=32, count=6)
    torch.manual_seed(123)
    second = T.fixed_sequences(data, ByteTokenizer(), seq_len=32, count=6)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert bytes(first[0][0].tolist()).decode().startswith("As You Like It")


def document_ids(windows):
    """The document ids ("doc-S-D ", repeated in every document) whole in some window: a window cut inside
    an id leaves either no "doc" or no trailing space, so no id is misread."""
    return {match for window in windows for match in re.findall(r"doc-\d+-\d+ ", bytes(window.tolist()).decode())}


def test_without_validation_files_a_fixed_slice_is_held_out_and_never_trained_on(tmp_path):
    write_shards(tmp_path, shards=2, docs=400)
    data = resolve_data_files(str(tmp_path / "c4-train.*.json.gz"))
    assert data.held_out_slice and data.val == data.train
    everything = {f"doc-{shard}-{doc} " for shard in range(2) for doc in range(400)}
    held_out = {d for d in everything if in_held_out_slice(d * 5)}
    assert 0 < len(held_out) < 20                                # about 1 in 100
    val = T.fixed_sequences(data, ByteTokenizer(), seq_len=32, count=8)
    assert document_ids(val[0]) and document_ids(val[0]) <= held_out
    assert torch.equal(val[0], T.fixed_sequences(data, ByteTokenizer(), seq_len=32, count=8)[0])
    cfg = parse_config(["--preset", "tiny", "--data-streams", "2", "--batch-size", "4"])
    batches = RankBatches(data.train, ByteTokenizer(), cfg, 0, 1, 4, skip_held_out=data.held_out_slice)
    trained = set()
    for _ in range(1000):                     # an epoch is about 300 batches; a second one repeats the first
        trained |= document_ids(batches.next_batch()[0])
        if trained >= everything - held_out:
            break
    assert trained == everything - held_out


def test_val_data_names_the_held_out_files_and_is_never_trained_on(tmp_path):
    train = write_shards(tmp_path, shards=2)
    held = write_shards(tmp_path / "held", shards=1, prefix="other")
    data = resolve_data_files(str(tmp_path / "*.json.gz"), val_data=str(tmp_path / "held"))
    assert (data.train, data.val, data.held_out_slice) == (train, held, False)
    assert resolve_data_files(str(tmp_path / "*.json.gz"), val_data=train[0]).train == train[1:]
    with pytest.raises(ConfigError, match="--val-data .* matches no file"):
        resolve_data_files("sample", val_data=str(tmp_path / "nothing*.json"))
    with pytest.raises(ConfigError, match="leaves no training file"):
        resolve_data_files(train[0], val_data=train[0])
