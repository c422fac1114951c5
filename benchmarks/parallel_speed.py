"""Training speed of the demo on one CPU: one process of all threads against torchrun's processes of one
thread each (DDP and FSDP2), optionally for several checkouts of tformer in the same run.

    python benchmarks/parallel_speed.py                          # this checkout
    python benchmarks/parallel_speed.py --code old=/tmp/old --code new=.   # two checkouts, alternating

Each configuration trains ``--steps`` steps of configs/demo.yaml (no validation) in a fresh folder; its
speed is the median of the logged target tokens/s after the first two log windows (warm-up). Rounds
alternate the configurations, so that a slow spell of a shared machine touches all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETUPS = {  # name: (processes, extra overrides)
    "1 process": (1, []),
    "2 processes ddp": (2, []),  # the default engine (before train.parallel: the hand-written sync)
    "2 processes fsdp": (2, ["train.parallel=fsdp"]),
}


def run_once(code: Path, processes: int, overrides: list[str], steps: int, folder: Path) -> float | None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] \
        if processes > 1 else [sys.executable]
    sets = [f"train.max_steps={steps}", "train.eval_every=1000000", "train.max_time=null", "train.log_every=10",
            *overrides]
    command = [*launcher, "-m", "tformer_cli", "train", str(ROOT / "configs" / "demo.yaml"), "--output-dir",
               str(folder), "--quiet", *[arg for s in sets for arg in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(code)}  # and run there: `python -m` puts the current folder first
    result = subprocess.run(command, cwd=code, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"  {code}: {' '.join(overrides) or 'plain'} failed: {result.stderr.strip().splitlines()[-1:]}")
        return None
    speeds = [r["tokens_per_s"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
              if r.get("split") == "train"]
    return statistics.median(speeds[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", action="append", default=[], help="LABEL=DIR of a tformer checkout (repeatable)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, from: " + ", ".join(SETUPS))
    args = parser.parse_args()
    codes = dict(c.split("=", 1) for c in args.code) or {"this checkout": str(ROOT)}
    setups = [s.strip() for s in args.setups.split(",")]
    results: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for label, code in codes.items():
                for setup in setups:
                    processes, overrides = SETUPS[setup]
                    folder = Path(tmp) / f"{label}-{setup}-{round_}".replace(" ", "_").replace(",", "")
                    speed = run_once(Path(code).resolve(), processes, overrides, args.steps, folder)
                    if speed is not None:
                        results.setdefault((label, setup), []).append(speed)
                        print(f"round {round_ + 1}: {label:>14} | {setup:<18} | {speed:8.0f} target tokens/s",
                              flush=True)
    print("\nmedian target tokens/s over rounds (demo, CPU):")
    base = None
    for (label, setup), speeds in results.items():
        median = statistics.median(speeds)
        base = base or median
        print(f"  {label:>14} | {setup:<18} | {median:8.0f} | {median / base:5.2f}x | "
              f"{' '.join(f'{s:.0f}' for s in speeds)}")


if __name__ == "__main__":
    main()
