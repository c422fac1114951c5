"""Resident memory of a real training run: the RSS curve of `tformer train` on Multi30k.

    python benchmarks/train_memory.py --minutes 10
    python benchmarks/train_memory.py --minutes 10 --products onednn   # fp32 products as on AMD CPUs with AVX-512

Trains configs/multi30k.yaml (with its validation BLEU every 500 steps) on the local Multi30k for the
given minutes, samples the process's RSS every few seconds, and prints the curve a minute at a time
(RSS, steps done, the logged target tokens/s), then the peak (VmHWM) and the median tokens/s. The
suite's fixed-shape workloads hide what real batches do: every batch shape can cost a compiled kernel
and heap that the process keeps. `--products onednn` sends fp32 products to oneDNN, as the speed
layer does on CPUs with AVX-512 not made by Intel, to see that elsewhere; `--products torch` leaves
them on torch's BLAS there. `--set` passes overrides on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tformer_cli.devices import resident_mib  # noqa: E402

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
# the speed layer's rule (gemm.pays_here) made to answer yes or no, then tformer's command line
FORCED_LAUNCH = ("import sys, tformer_cli.accel.gemm as g; g.pays_here = lambda: {}; "
                 "from tformer_cli.cli import app; sys.argv[0] = 'tformer'; app()")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "multi30k.yaml")  # absolute: --code
    parser.add_argument("--data", type=Path, default=MULTI30K)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--products", choices=("auto", "onednn", "torch"), default="auto",
                        help="where fp32 products run: as the speed layer decides here, or forced")
    parser.add_argument("--set", nargs="*", default=[], dest="overrides")
    parser.add_argument("--code", type=Path, default=ROOT, help="the tformer checkout to train with (default: this one)")
    parser.add_argument("--json", type=Path, help="write the samples here")
    args = parser.parse_args()
    launch = [sys.executable, "-m", "tformer_cli"] if args.products == "auto" else \
        [sys.executable, "-c", FORCED_LAUNCH.format(args.products == "onednn")]
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        overrides = [f"data.dataset={args.data}", f"train.max_time={int(args.minutes * 60)}", *args.overrides]
        command = [*launch, "train", str(args.config), "--output-dir", str(run), "--device", "cpu",
                   *(part for override in overrides for part in ("--set", override))]
        env = {**os.environ, "PYTHONPATH": str(args.code.resolve())}
        errors = (Path(folder) / "stderr").open("w+")  # a file, not a pipe: a full pipe would stall the run
        process = subprocess.Popen(command, cwd=args.code, env=env, stdout=subprocess.DEVNULL, stderr=errors)
        start, samples = time.perf_counter(), []
        while process.poll() is None:
            rss, peak = resident_mib(pid=process.pid), resident_mib(peak=True, pid=process.pid)
            if rss is not None and peak is not None:
                samples.append({"s": round(time.perf_counter() - start, 1), "rss_mib": rss, "hwm_mib": peak})
            time.sleep(args.every)
        if process.returncode != 0:
            errors.seek(0)
            sys.exit(f"training failed ({process.returncode}): {errors.read()[-2000:]}")
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logged if r.get("split") == "train"]
    print(" ".join([f"code {args.code};", f"products: {args.products};", *overrides]))
    print("minute  RSS MiB  peak MiB  steps  tokens/s (last log)")
    for minute in range(1, int(args.minutes) + 2):
        at = [s for s in samples if s["s"] <= minute * 60]
        if not at:
            continue
        logs = [r for r in train if r.get("elapsed", 0) <= minute * 60]
        last = logs[-1] if logs else {}
        print(f"{minute:>6}  {at[-1]['rss_mib']:>7,.0f}  {at[-1]['hwm_mib']:>8,.0f}  {last.get('step', 0):>5}  "
              f"{last.get('tokens_per_s', 0):>8,.0f}")
    rates = [r["tokens_per_s"] for r in train[1:]]  # the first window holds the start
    print(f"peak RSS {max(s['hwm_mib'] for s in samples):,.0f} MiB; steps {train[-1]['step'] if train else 0}; "
          f"median tokens/s {statistics.median(rates) if rates else 0:,.0f}")
    if args.json:
        args.json.write_text(json.dumps({"command": command, "samples": samples, "train": train}, indent=1))


if __name__ == "__main__":
    main()
