"""C4's first train shards and its validation shards, downloaded once per node: `bash setup.sh --prefetch-c4 N`
(python -m hcstudy.c4_download N DIR). Training then reads the local copy (docs/data.md)."""
import sys

from hcstudy.contract import hub_unreachable


def download_c4(count: int, folder: str) -> None:
    """The first `count` C4 train shards and the 8 validation shards into `folder`. huggingface_hub downloads under a
    file lock into a temporary file, renames it when complete and resumes partial downloads, so concurrent or
    interrupted prefetches are safe; HF_TOKEN is used if set."""
    import huggingface_hub
    names = [f"en/c4-train.{i:05d}-of-01024.json.gz" for i in range(count)]
    names += [f"en/c4-validation.{i:05d}-of-00008.json.gz" for i in range(8)]
    for number, name in enumerate(names, 1):
        try:
            huggingface_hub.hf_hub_download("allenai/c4", name, repo_type="dataset", local_dir=folder)
        except Exception as error:
            # huggingface_hub says LocalEntryNotFoundError (not in the cache) when it cannot connect at all
            if hub_unreachable(error) or type(error).__name__ == "LocalEntryNotFoundError":
                sys.exit("setup.sh: the Hugging Face hub cannot be reached (no network, no name server, or "
                         "HF_HUB_OFFLINE set); check the connection or HF_ENDPOINT and rerun "
                         f"(the {number - 1} file(s) done are kept)")
            sys.exit(f"setup.sh: could not download {name} ({type(error).__name__}); rerun to resume")
        print(f"setup.sh: C4 shard {number}/{len(names)} ready: {folder}/{name}", flush=True)
    print(f"setup.sh: train on the local copy with --data '{folder}/en/*.json.gz' (and HF_HUB_OFFLINE=1)")


if __name__ == "__main__":        # setup.sh --prefetch-c4 N DIR
    download_c4(int(sys.argv[1]), sys.argv[2])
