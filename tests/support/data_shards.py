"""C4-like shards written by hand (gzip JSON lines, as the hub serves them) and what the data tests read back."""
import gzip
import json


def write_shards(folder, shards=4, docs=30, prefix="c4-train"):
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        with gzip.open(folder / f"{prefix}.{shard:05d}-of-{shards:05d}.json.gz", "wt") as f:
            for doc in range(docs):
                f.write(json.dumps({"text": f"doc-{shard}-{doc} " * 5, "timestamp": "2019-04-25T12:00:00Z",
                                    "url": f"https://example.com/{shard}/{doc}"}) + "\n")
    return sorted(str(p) for p in folder.glob(f"{prefix}*"))
