"""What each piece of the speed layer (tformer_cli/accel) buys: tformer alone, with every piece, with
each piece left out, and plain (--accel off), on training, greedy and beam search at small and base.

    python benchmarks/accel_table.py                 # 2 rounds, the variants alternating within each
    python benchmarks/accel_table.py --rounds 3 --sizes small

Prints a markdown table: each variant's median over the rounds, as a share of the full layer's speed
(what a piece buys is how much slower the run is without it). A piece that buys under 3 % on every
workload has not earned its place (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tformer_cli.accel import CUDA_PIECES, PIECES  # noqa: E402

RUN = Path(__file__).resolve().parent / "run.py"


def variants() -> dict[str, list[str]]:
    out = {"all pieces": []}
    out.update({f"without {piece}": ["--accel-skip", piece] for piece in PIECES if piece not in CUDA_PIECES})
    out["off (plain model)"] = ["--accel", "off"]
    return out


def measure(args: list[str], sizes: str, workloads: str) -> dict[tuple[str, str], float]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run.json"
        subprocess.run([sys.executable, str(RUN), "--peers", "", "--sizes", sizes, "--workloads", workloads,
                        "--json", str(out), *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        records = json.loads(out.read_text())["records"]
    return {(r["workload"], r["size"]): r["median"] for r in records if r["system"] == "tformer"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sizes", default="small,base")
    parser.add_argument("--workloads", default="train,greedy,beam")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {name: [] for name in variants()}
    for round_ in range(args.rounds):
        for name, flags in variants().items():
            results[name].append(measure(flags, args.sizes, args.workloads))
            print(f"round {round_ + 1}: {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    keys = sorted(results["all pieces"][0])
    median = {name: {k: statistics.median(run[k] for run in runs) for k in keys} for name, runs in results.items()}
    print("| variant | " + " | ".join(f"{w} {s}" for w, s in keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    full = median["all pieces"]
    print("| all pieces (tokens/s) | " + " | ".join(f"{full[k]:,.0f}" for k in keys) + " |")
    for name in list(results)[1:]:
        print(f"| {name} | " + " | ".join(f"{median[name][k] / full[k]:.2f}×" for k in keys) + " |")
    print(json.dumps({"median": {n: {f"{w}/{s}": v for (w, s), v in m.items()} for n, m in median.items()}}),
          file=sys.stderr)


if __name__ == "__main__":
    main()
