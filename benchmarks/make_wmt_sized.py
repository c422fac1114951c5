"""Write a corpus the size of WMT 2014 en-de (4.5 million pairs) from Multi30k's training split, to
measure what training's start costs at the paper's scale (benchmarks/README.md, "Data at scale").

    python benchmarks/make_wmt_sized.py ../shared/data/multi30k /tmp/wmt-sized    # ~1 GB of parquet

Multi30k's 29,000 pairs are repeated 155 times. Each copy varies every pair, so that BPE meets text as
varied as a real corpus rather than one set of sentences: a word on each side becomes a made-up name
(the same name on both sides, as names are) from a pool of 500,000, drawn so that a few are common and
most are rare, and some pairs are joined with the next one. WMT 2014 en-de has on the order of a
million word types a side; this corpus has Multi30k's ~20,000 and the names. The validation and test
splits are copied as they are.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYLLABLES = [c + v for c in "bdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ei", "au")]
ROWS_PER_GROUP = 250_000
NAMES = 500_000


def made_up_name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()


def vary(source: str, target: str, names: list[str], rng: random.Random) -> tuple[str, str]:
    """One word of each side replaced by the same made-up name (name i drawn with weight ~1/i)."""
    name = names[min(int(len(names) ** rng.random()) - 1, len(names) - 1)]
    src, tgt = source.split(), target.split()
    if src and tgt:
        src[rng.randrange(len(src))] = name
        tgt[rng.randrange(len(tgt))] = name
    return " ".join(src), " ".join(tgt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multi30k", type=Path, help="folder with train.jsonl, validation.jsonl, test.jsonl")
    parser.add_argument("output", type=Path)
    parser.add_argument("--pairs", type=int, default=4_500_000)
    parser.add_argument("--source", default="en")
    parser.add_argument("--target", default="de")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.multi30k / "train.jsonl").read_text(encoding="utf-8").splitlines()]
    base = [(r[args.source], r[args.target]) for r in rows]
    args.output.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    names = [made_up_name(rng) for _ in range(NAMES)]
    schema = pa.schema([(args.source, pa.string()), (args.target, pa.string())])
    written = 0
    with pq.ParquetWriter(args.output / "train.parquet", schema) as writer:
        while written < args.pairs:
            sources, targets = [], []
            while len(sources) < ROWS_PER_GROUP and written + len(sources) < args.pairs:
                i = (written + len(sources)) % len(base)
                source, target = vary(*base[i], names, rng)
                if rng.random() < 0.1:  # a longer pair: this one and the next
                    more = vary(*base[(i + 1) % len(base)], names, rng)
                    source, target = f"{source} {more[0]}", f"{target} {more[1]}"
                sources.append(source)
                targets.append(target)
            writer.write_table(pa.table({args.source: sources, args.target: targets}, schema=schema))
            written += len(sources)
            print(f"{written:,} pairs", flush=True)
    for split in ("validation", "test"):
        shutil.copy(args.multi30k / f"{split}.jsonl", args.output / f"{split}.jsonl")
    print(f"wrote {args.output} ({sum(p.stat().st_size for p in args.output.iterdir()) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
