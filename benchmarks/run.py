"""Benchmark tformer against its peers in one run, on this machine.

    python benchmarks/run.py                                  # every workload, sizes small and base
    python benchmarks/run.py --workloads train,greedy --sizes small --json results.json
    python benchmarks/run.py --device cuda                    # bf16 autocast on a GPU
    python benchmarks/run.py --precision bf16                 # bf16 autocast on a CPU with AVX-512 BF16 / AMX
    python benchmarks/run.py --device cuda --scale paper      # base and big, ~25,000 target tokens a step

`--scale paper` trains as the paper did instead of on one fixed batch of 24-token sentences: steps of
about 25,000 target tokens (`--paper-tokens`) cut by tformer's own batching from a corpus of WMT 2014's
size (4.5 M sentence pairs) whose lengths are drawn like real data (mean ~27 tokens, a tail past 100),
a few different steps (`--paper-steps`, evenly spaced in length order) per repetition, nn.Transformer
under torch.compile; decoding translates a test set of such lengths (`--paper-sentences`, 3,000)
batched by tokens, in sentences/s; sizes base and big.
For each workload and size, the systems run alternately in one fresh process, several timed
repetitions after warm-up; the table gives medians, min-max and tformer's ratio to the best peer.
Peers: torch's nn.Transformer (a), Hugging Face MarianMTModel (b), x-transformers (c), and for
decoding CTranslate2 in float32 (d) and with int8 weights (e); install them with `pip install -e '.[bench]'`.
`--peers ct2-int8,tformer-int8` adds tformer's own int8 decoding (CPU) beside them, and
`tformer-compile` its training with `train.compile: true` (`tformer-compile-layers`: each layer compiled on
its own, an experiment); tformer's variants are not counted as peers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from systems import (DEFAULT_PEERS, PAD, PEERS, SIZES, Tformer, at_least, available_peers,  # noqa: E402
                     make_batch, paper_batches, paper_sources)

import systems  # noqa: E402
from tformer_cli.accel import PIECES  # noqa: E402
from tformer_cli.accel.linear import PACKING, PACKING_BF16  # noqa: E402
from tformer_cli.accel.ops import LINEAR_POINTWISE, REORDER_LINEAR_WEIGHT  # noqa: E402
from tformer_cli.devices import PRECISION_DTYPES, best_seconds, reset_peak_memory, resident_mib  # noqa: E402

WORKLOADS = ("train", "greedy", "beam", "memory", "data")
HIGHER_IS_BETTER = {"train": True, "greedy": True, "beam": True, "memory": False, "data": True}
MULTI30K = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "multi30k"


def matmul_peak(device: torch.device, precision: str) -> float:
    """Measured FLOP/s of a large matrix product in the benchmark's precision: on a CPU the faster of
    torch's product (MKL) and oneDNN's with a packed weight, which on an AMD EPYC ran 18 % faster."""
    n = 2048 if device.type == "cpu" else 8192
    dtype = PRECISION_DTYPES[precision]
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    products = [lambda: a @ b]
    if device.type == "cpu" and (PACKING_BF16 if dtype == torch.bfloat16 else PACKING):
        packed = REORDER_LINEAR_WEIGHT(b, n)
        products.append(lambda: LINEAR_POINTWISE(a, packed, None, "none", [], ""))
    return max(2 * n**3 / best_seconds(product, device) for product in products)


def _now(device: torch.device) -> float:
    systems.sync(device)
    return time.perf_counter()


PRECISION = "fp32"  # set once by main(): every system runs under the same autocast
PAPER: tuple[int, int, int] | None = None  # set by main() with --scale paper: (tokens a step, steps, sentences)
# --scale paper decodes batches of at most this many hypothesis tokens (sentences x beams x longest
# source), as `tformer eval --max-tokens 8192` (--paper-decode-tokens sets it)
PAPER_DECODE_TOKENS = 8192
PEER_ADAMW = "both"  # --peer-adamw: the peers train with plain and with fused AdamW, or "fused" only


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if PRECISION == "bf16" else nullcontext()


def _systems(size, device, peers: list[str], train: bool) -> list:
    """tformer and the peers; for training, each peer with plain and fused AdamW (--peer-adamw)."""
    systems = [Tformer(SIZES[size], device)]
    for key in peers:
        if train and not PEERS[key].supports_train:
            continue
        if key.startswith("tformer") or not train:  # tformer's variants have their own optimizer; decoding none
            systems.append(PEERS[key](SIZES[size], device))
            continue
        for fused in (True,) if PEER_ADAMW == "fused" else (False, True):
            systems.append(PEERS[key](SIZES[size], device, fused=fused))
    return systems


def _alternate(systems, operation, work: float, device, repeats: int, warmup: int,
               warm_operation=None) -> tuple[dict[str, list[float]], dict[str, float]]:  # noqa: ANN001
    """Time ``operation(system)`` for each system in turn; return work/second per repetition, and the
    seconds each system's warm-up took (compiling included): ``warmup`` runs of ``warm_operation``
    (default: ``operation``)."""
    working, warmup_s = [], {}
    for system in systems:
        try:
            start = _now(device)
            for _ in range(warmup):
                with _autocast(device):
                    (warm_operation or operation)(system)
            warmup_s[system.name] = _now(device) - start
            print(f"{system.name}: warmed up in {warmup_s[system.name]:.1f} s", file=sys.stderr)
            working.append(system)
        except RuntimeError as error:  # e.g. nn.Transformer's inference fast path under CPU bf16 autocast
            print(f"skipping {system.name}: {str(error).splitlines()[0]}", file=sys.stderr)
    rates: dict[str, list[float]] = {s.name: [] for s in working}
    for _ in range(repeats):
        for system in working:
            start = _now(device)
            with _autocast(device):
                operation(system)
            rates[system.name].append(work / (_now(device) - start))
    return rates, warmup_s


def flops_per_target_token(size_name: str, batches: list) -> float:
    """The model FLOPs a target token of training on ``batches`` costs (its source tokens' share included)."""
    from tformer_cli.config import ModelConfig
    from tformer_cli.params import train_flops_per_token

    s = SIZES[size_name]
    cfg = ModelConfig(d_model=s.d_model, num_heads=s.heads, num_encoder_layers=s.layers,
                      num_decoder_layers=s.layers, d_ff=s.d_ff)
    src_per_tgt = sum(int((b.src != PAD).sum()) for b in batches) / sum(b.target_tokens for b in batches)
    return train_flops_per_token(cfg, s.vocab, src_per_tgt=src_per_tgt)


def train_batches(size: str, device, train_batch: int) -> list:
    """The batches one timed repetition trains on: one of ``train_batch`` sentences of 24 tokens, or
    with --scale paper a few steps of real-length sentences at the paper's tokens a step."""
    if PAPER is None:
        return [make_batch(SIZES[size], train_batch, 24, device)]
    tokens, steps, _ = PAPER
    return paper_batches(SIZES[size], tokens, steps, device)


def run_speed(workload: str, size: str, device, peers, repeats, warmup, peak, train_batch: int = 64) -> list[dict]:
    systems.COMPILE_PEERS = PAPER is not None and workload == "train"  # the peers' training at its best
    contenders = _systems(size, device, peers, train=workload == "train")
    if workload == "train":
        batches = train_batches(size, device, train_batch)
        target = sum(b.target_tokens for b in batches)
        rates, warmup_s = _alternate(contenders, lambda s: [s.train_step(b) for b in batches], target, device,
                                     repeats, warmup)
        unit, flops = "target tok/s", flops_per_target_token(size, batches)
    else:
        batch_size, beams = (64, 1) if workload == "greedy" else (16, 4)
        batch_size = 1 if size == "host" else batch_size
        if PAPER is None:  # one batch, exactly 24 new tokens a sentence
            batches, work, unit = [(make_batch(SIZES[size], batch_size, 24, device).src, 24)], batch_size * 24, "new tok/s"
        else:  # a test set of real lengths
            batches = paper_sources(SIZES[size], PAPER[2], PAPER_DECODE_TOKENS, beams, device)
            work, unit = sum(src.shape[0] for src, _ in batches), "sentences/s"
        contenders = [s for s in contenders if s.decodes]
        if workload == "beam":
            contenders = [s for s in contenders if s.supports_beam]

        def decode(system, batches):
            for src, new_tokens in batches:
                system.greedy(src, new_tokens) if beams == 1 else system.beam(src, new_tokens, beams)

        # the test set warms up on its shortest and longest batches: a whole pass costs some peers minutes
        # (Marian's beam 4 on an H100, 2026-11-27), and nothing decoding compiles needs more
        warm_batches = [batches[0], batches[-1]] if len(batches) > 2 else batches
        rates, warmup_s = _alternate(contenders, lambda system: decode(system, batches), work, device, repeats,
                                     warmup, lambda system: decode(system, warm_batches))
        flops = None
    records = []
    for name, values in rates.items():
        record = {"workload": workload, "size": size, "system": name, "median": statistics.median(values),
                  "min": min(values), "max": max(values), "unit": unit, "warmup_s": warmup_s[name]}
        if flops:
            record["mfu"] = record["median"] * flops / peak
        records.append(record)
    return records


def run_speed_fresh(workload: str, size: str, args: argparse.Namespace, peers: list[str], peak: float) -> list[dict]:
    """``run_speed`` in a fresh process: no workload runs on the heap an earlier one left behind (after
    training at "base", greedy decoding at "small" ran 8-15 % slower for every system), so a figure does
    not depend on which workloads ran before it."""
    command = [sys.executable, __file__, "--probe-speed", workload, size, "--peak", repr(peak),
               "--device", args.device, "--precision", PRECISION, "--accel", systems.ACCEL, "--accel-skip", ",".join(systems.ACCEL_SKIP),
               "--peers", ",".join(peers), "--peer-adamw", PEER_ADAMW,
               "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--train-batch", str(args.train_batch),
               *_scale_flags(args)]
    out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _scale_flags(args: argparse.Namespace) -> list[str]:
    """--scale and its sizes, for the fresh processes."""
    return ["--scale", args.scale, "--paper-tokens", str(args.paper_tokens), "--paper-steps", str(args.paper_steps),
            "--paper-sentences", str(args.paper_sentences), "--paper-decode-tokens", str(args.paper_decode_tokens)]


def _process_settings() -> None:
    """tformer's process-wide settings (allocator, oneDNN's kernel cache) hold for every system in the
    process, peers too, unless tformer's speed layer is off or its "runtime" piece left out."""
    from tformer_cli.accel import tune_runtime

    if systems.ACCEL == "auto" and "runtime" not in systems.ACCEL_SKIP:
        tune_runtime()


def probe_memory(system_key: str, size: str, device_name: str, precision: str) -> dict:
    """In a fresh process: peak memory of training steps above the memory before the model existed."""
    global PRECISION
    PRECISION = precision
    device = torch.device(device_name)
    _process_settings()
    systems.COMPILE_PEERS = PAPER is not None
    cls = Tformer if system_key == "tformer" else PEERS[system_key]
    importlib.import_module(cls.library)  # library code is loaded before the baseline
    batches = train_batches(size, device, 64)
    reset_peak_memory(device)
    base = resident_mib() or 0.0
    system = cls(SIZES[size], device, fused=True)
    for _ in range(3 if PAPER is None else 1):
        for batch in batches:
            with _autocast(device):
                system.train_step(batch)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = (resident_mib(peak=True) or 0.0) - base
    return {"system": system.name, "peak_mib": peak}


def run_memory(size: str, device, peers, repeats: int, scale_flags: list[str]) -> list[dict]:
    """Each system's peak in ``repeats`` fresh processes: a CPU peak moves by tens of MiB between runs."""
    records = []
    unit = "MiB CUDA peak" if device.type == "cuda" else "MiB peak RSS"
    for key in ["tformer", *(p for p in peers if PEERS[p].supports_train)]:  # the peak of training steps
        peaks = []
        for _ in range(repeats):
            out = subprocess.run([sys.executable, __file__, "--probe-memory", key, size, device.type, PRECISION,
                                  "--accel", systems.ACCEL, "--accel-skip", ",".join(systems.ACCEL_SKIP), *scale_flags],
                                 capture_output=True, text=True, check=True)
            probe = json.loads(out.stdout.strip().splitlines()[-1])
            peaks.append(probe["peak_mib"])
        records.append({"workload": "memory", "size": size, "system": probe["system"],
                        "median": statistics.median(peaks), "min": min(peaks), "max": max(peaks), "unit": unit})
    return records


def run_data(step_seconds: float | None) -> list[dict]:
    """Tokenise and batch Multi30k's training pairs (or generated text when it is absent)."""
    from tformer_cli.config import DataConfig, TrainConfig
    from tformer_cli.batching import collate, token_batches
    from tformer_cli.data import load_pairs
    from tformer_cli.encoding import encode_split
    from tformer_cli.tokenizer import Vocabulary

    if MULTI30K.is_dir():
        cfg = DataConfig(data_files={"train": str(MULTI30K / "train.jsonl")}, source="de", target="en")
        pairs, source = load_pairs(cfg, "train"), "Multi30k"
    else:
        from data.make_numbers import english, german  # noqa: F401 - the repo's own generator

        pairs, source = [(english(n), german(n)) for n in range(1, 29001)], "generated"
        cfg = DataConfig()
    vocab = Vocabulary.train(pairs, 8000)
    start = time.perf_counter()
    encoded = encode_split(pairs, vocab, cfg)
    batches = token_batches(encoded.src.lengths(), encoded.tgt.lengths(), 4096,
                            multiple=TrainConfig().batch_multiple)
    collate_start = time.perf_counter()
    for indices in batches:
        collate(encoded, indices)
    end = time.perf_counter()
    per_batch = (end - collate_start) / len(batches)
    record = {"workload": "data", "size": source, "system": "tformer", "median": len(pairs) / (end - start),
              "min": len(pairs) / (end - start), "max": len(pairs) / (end - start), "unit": "pairs/s",
              "collate_ms_per_batch": 1000 * per_batch}
    if step_seconds:
        record["collate_share_of_step"] = per_batch / step_seconds
    return [record]


def add_ratios(records: list[dict]) -> None:
    """ratio_vs_best_peer on tformer's records, its variants' (``tformer +compile``, the GPU default) each
    against the best peer too, never against one another: > 1 is better for speed, < 1 better for memory."""
    for record in records:
        if not record["system"].startswith("tformer") or record["workload"] == "data":
            continue
        peers = [r["median"] for r in records if r["workload"] == record["workload"] and r["size"] == record["size"]
                 and not r["system"].startswith("tformer")]
        if peers:
            best = max(peers) if HIGHER_IS_BETTER[record["workload"]] else min(peers)
            record["ratio_vs_best_peer"] = record["median"] / best


def print_table(records: list[dict], device: str, peak: float) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"tformer vs peers on {device} · {PRECISION} · matmul peak {peak / 1e9:,.0f} GFLOP/s"
    table = Table(title=title, title_justify="left")
    for column in ("workload", "size", "system", "median", "min–max", "unit", "MFU", "tformer / best peer"):
        table.add_column(column, justify="right" if column not in ("workload", "system", "unit", "size") else "left")
    for r in records:
        ratio = f"{r['ratio_vs_best_peer']:.2f}×" if "ratio_vs_best_peer" in r else ""
        if "collate_ms_per_batch" in r:  # the data path: does batching stall a training step?
            ratio = f"collate {r['collate_ms_per_batch']:.2f} ms a batch"
            if "collate_share_of_step" in r:
                ratio += f", {100 * r['collate_share_of_step']:.2f} % of a step"
        spread = f"{r['min']:,.0f}–{r['max']:,.0f}"
        table.add_row(r["workload"], r["size"], r["system"], f"{r['median']:,.1f}", spread, r["unit"],
                      f"{r['mfu']:.2f}" if "mfu" in r else "", ratio)
    console = Console()
    if not console.is_terminal:  # a log file or pipe: one line a row, not Rich's default 80 columns
        console.width = max(console.width, 140)
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    global PAPER_DECODE_TOKENS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", help=f"of {','.join(WORKLOADS)} (default: all; train,memory,greedy,beam with --scale paper)")
    parser.add_argument("--sizes", help="of small,base,big,host (default: small,base; base,big with --scale paper; "
                                        "host: decoding's host overhead, one sentence a batch)")
    parser.add_argument("--scale", default="suite", choices=["suite", "paper"],
                        help="suite: one fixed batch of 24-token sentences a step; paper: real lengths, 25k tokens a step")
    parser.add_argument("--paper-tokens", type=at_least(64), default=25_000, help="target tokens a step (--scale paper)")
    parser.add_argument("--paper-steps", type=at_least(1), default=6, help="different steps a repetition (--scale paper)")
    parser.add_argument("--paper-sentences", type=at_least(1), default=3000,
                        help="sentences to translate, greedy and beam (--scale paper)")
    parser.add_argument("--paper-decode-tokens", type=at_least(1), default=PAPER_DECODE_TOKENS,
                        help="hypothesis tokens a decoding batch, sentences x beams x longest source, as tformer "
                             "eval --max-tokens (--scale paper)")
    parser.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                        help="peers to compare with; also tformer's variants tformer-int8 (--precision int8 "
                             "decoding, CPU only), tformer-compile (train.compile: true), "
                             "tformer-compile-layers (each layer compiled on its own), tformer-pack and "
                             "tformer-compile-pack (train.pack_length: 128, eager and compiled)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=at_least(1), help="timed repetitions (default: 5 on CPU, 11 on CUDA)")
    parser.add_argument("--warmup", type=at_least(0), default=2)
    parser.add_argument("--memory-repeats", type=at_least(1),
                        help="fresh processes per memory probe (default: 3 on CPU, 1 on CUDA, whose peak is exact)")
    parser.add_argument("--train-batch", type=at_least(1),
                        help="sentences of 24 tokens per training step (default: 64 on CPU, 512 on CUDA)")
    parser.add_argument("--precision", choices=["fp32", "bf16"],
                        help="autocast for every system (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--accel", default="auto", choices=["auto", "off"],
                        help="tformer's speed layer (tformer_cli/accel): auto, or off for the plain model")
    parser.add_argument("--accel-skip", default="",
                        help="pieces of the speed layer to leave out, e.g. dropout,attention (see accel.PIECES)")
    parser.add_argument("--peer-adamw", default="both", choices=["both", "fused"],
                        help="the peers' training with plain and fused AdamW, or fused only (their best, in half the time)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--probe-memory", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--probe-speed", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    on_cuda = args.device == "cuda"
    args.repeats = args.repeats or (11 if on_cuda else 5)
    args.memory_repeats = args.memory_repeats or (1 if on_cuda else 3)
    args.train_batch = args.train_batch or (512 if on_cuda else 64)
    paper = args.scale == "paper"
    args.workloads = args.workloads or ("train,memory,greedy,beam" if paper else ",".join(WORKLOADS))
    args.sizes = args.sizes or ("base,big" if paper else "small,base")
    for flag, given, known in (("--workloads", args.workloads, WORKLOADS), ("--sizes", args.sizes, SIZES),
                               ("--accel-skip", args.accel_skip, PIECES)):
        unknown = sorted(set(filter(None, given.split(","))) - set(known))
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    global PRECISION
    PRECISION = systems.PRECISION = args.precision or ("bf16" if on_cuda else "fp32")
    global PAPER, PEER_ADAMW
    PEER_ADAMW, PAPER_DECODE_TOKENS = args.peer_adamw, args.paper_decode_tokens
    PAPER = (args.paper_tokens, args.paper_steps, args.paper_sentences) if paper else None
    systems.ACCEL = args.accel
    systems.ACCEL_SKIP = tuple(piece for piece in args.accel_skip.split(",") if piece)
    if args.probe_memory:
        print(json.dumps(probe_memory(*args.probe_memory)))
        return
    _process_settings()
    torch.manual_seed(0)
    device = torch.device(args.device)
    peers = [p for p in args.peers.split(",") if p in available_peers() and not (on_cuda and p == "tformer-int8")]
    if args.probe_speed:
        workload, size = args.probe_speed
        print(json.dumps(run_speed(workload, size, device, peers, args.repeats, args.warmup, args.peak,
                                   args.train_batch)))
        return
    missing = sorted(set(args.peers.split(",")) - set(peers))
    if missing:
        print(f"skipping peers that are not installed: {', '.join(missing)} (pip install -e '.[bench]')")
    peak = matmul_peak(device, PRECISION)
    records: list[dict] = []
    meta = {"device": args.device, "precision": PRECISION, "accel": args.accel,
            "accel_skip": list(systems.ACCEL_SKIP), "matmul_peak_flops": peak, "torch": torch.__version__}
    if PAPER is not None:
        meta["paper"] = dict(zip(("tokens", "steps", "sentences", "decode_tokens"), (*PAPER, PAPER_DECODE_TOKENS)))

    def save() -> None:  # after every workload and size: a run cut short by a time limit keeps what it measured
        add_ratios(records)
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=1))

    for workload in args.workloads.split(","):
        for size in args.sizes.split(","):
            if workload in ("train", "greedy", "beam"):
                records += run_speed_fresh(workload, size, args, peers, peak)
            elif workload == "memory":
                records += run_memory(size, device, peers, args.memory_repeats, _scale_flags(args))
            save()
        if workload == "data":
            step = next((args.train_batch * 24 / r["median"] for r in records
                         if r["workload"] == "train" and r["system"] == "tformer" and r["size"] == "small"), None)
            records += run_data(step)
            save()
        print(f"done: {workload}", file=sys.stderr)
    print_table(records, f"{device.type} ({os.cpu_count()} cores)" if device.type == "cpu"
                else torch.cuda.get_device_name(), peak)


if __name__ == "__main__":
    main()
