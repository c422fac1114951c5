"""Training's start at the paper's data scale: time from the command to the first training step, and
each training process's peak resident memory, for one process and for torchrun's processes.

    python benchmarks/make_wmt_sized.py ../shared/data/multi30k /tmp/wmt-sized
    python benchmarks/data_scale.py /tmp/wmt-sized --processes 1 2

The run is configs/wmt14-en-de.yaml's data (a joint 37,000-token BPE vocabulary, pairs of up to 128
tokens) on the corpus's parquet files, on the CPU, stopped after one step. That step is kept small (a
256-wide model, batches of 4,096 tokens), so that the memory measured is the data's: the base model's
step at 25,000 tokens alone takes ~12 GB on a CPU. The first launch starts from an empty cache (learn
BPE, tokenise, cache); the later ones find it filled, as a second run would.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_config(corpus: Path, folder: Path) -> Path:
    path = folder / "wmt-sized.yaml"
    path.write_text(f"""extends: {ROOT / 'configs' / 'wmt14-en-de.yaml'}
data:
  dataset: null
  subset: null
  source: en
  target: de
  data_files:
    train: {corpus / 'train.parquet'}
    validation: {corpus / 'validation.jsonl'}
    test: {corpus / 'test.jsonl'}
model:
  d_model: 256
  num_heads: 4
  num_encoder_layers: 3
  num_decoder_layers: 3
  d_ff: 1024
train:
  step_tokens: null
  max_tokens: 4096
  device: cpu
  precision: fp32
  max_steps: 1
  log_every: 1
  eval_every: 1000000
""")
    return path


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    found, frontier = [], children(pid)
    while frontier:
        found.append(frontier.pop())
        frontier += children(found[-1])
    return found


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def launch(config: Path, processes: int, run: Path, cache: Path) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] \
        if processes > 1 else [sys.executable]
    command = [*launcher, "-m", "tformer_cli", "train", str(config), "--output-dir", str(run), "--quiet"]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "TFORMER_CACHE": str(cache)},
                               stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}  # the training processes'
    helpers: dict[int, float] = {}  # their tokenising workers'
    first_step = None
    while process.poll() is None:
        ranks = children(process.pid) if processes > 1 else [process.pid]  # torchrun's children train
        for pid in ranks + [d for rank in ranks for d in descendants(rank)]:
            rss = peak_rss_mib(pid)
            if rss is not None:
                table = peaks if pid in ranks else helpers
                table[pid] = max(table.get(pid, 0.0), rss)
        if first_step is None and (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size:
            first_step = time.perf_counter() - start
        time.sleep(0.1)
    if process.returncode != 0:
        raise SystemExit(f"training failed: {process.stderr.read()[-2000:]}")
    return {"first_step_s": first_step, "peak_rss_mib": sorted(peaks.values(), reverse=True)[:processes],
            "worker_peak_rss_mib": max(helpers.values(), default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, help="folder written by make_wmt_sized.py")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp), Path(tmp) / "cache"
        config = write_config(args.corpus.resolve(), folder)
        runs = [(args.processes[0], "empty")] + [(n, "filled") for n in args.processes]
        for i, (processes, state) in enumerate(runs):
            result = launch(config, processes, folder / f"run-{i}", cache)
            rss = ", ".join(f"{r:,.0f}" for r in result["peak_rss_mib"])
            workers = f"; its workers' peak {result['worker_peak_rss_mib']:,.0f} MiB" \
                if result["worker_peak_rss_mib"] else ""
            print(f"{processes} process(es), cache {state}: first step after {result['first_step_s']:.1f} s; "
                  f"peak RSS {rss} MiB{workers}", flush=True)


if __name__ == "__main__":
    main()
