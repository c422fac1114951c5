"""Does the speed layer's dropout (SplitMix64 masks, accel/dropout.py) train as well as torch's?

    python benchmarks/dropout_experiment.py --seeds 1,2,3,4 --steps 800

For each seed, trains configs/multi30k-en-de.yaml on the local Multi30k twice, in fp32 for the same
number of steps (warmup shortened to half of them, at most the recipe's 1,600): once with the whole speed layer, once with its dropout pieces left out (torch's
dropout in the layers, and torch's attention with its own dropout). Nothing else differs: in fp32
the other pieces change speed, not results. Then scores test2016 with greedy decoding and prints
BLEU per seed and the mean difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"
VARIANTS = {"splitmix": (), "torch": ("dropout", "attention")}


def use_variant(variant: str) -> None:
    """Have training in this process build its models with the speed layer less ``VARIANTS[variant]``:
    every model it trains is built through ``run_setup.accelerate``, whose own ``skip`` it adds to."""
    import tformer_cli.run_setup as run_setup
    from tformer_cli.accel import accelerate

    def accelerate_less(model, device, mode="auto", skip=(), **kwargs):  # noqa: ANN001, ANN202
        return accelerate(model, device, mode, skip=(*skip, *VARIANTS[variant]), **kwargs)

    run_setup.accelerate = accelerate_less


def one_run(variant: str, seed: int, steps: int, folder: Path) -> dict:
    """Train and score one (variant, seed) in this process."""
    import time

    import tformer_cli.train as training
    from tformer_cli.config import load_config
    from tformer_cli.decoding import DecodeOptions
    from tformer_cli.evaluation import evaluate_run
    from tformer_cli.runtime import load_run

    use_variant(variant)
    config = load_config(ROOT / "configs" / "multi30k-en-de.yaml", [
        f"data.dataset={MULTI30K}", "train.precision=fp32", f"train.seed={seed}", f"train.max_steps={steps}",
        "train.max_time=null", f"train.warmup_steps={min(1600, steps // 2)}", f"train.eval_every={steps}", "train.eval_bleu=false", "train.best_metric=loss",
        f"train.save_every={steps}", "train.device=cpu"])
    start = time.perf_counter()
    training.train(config, folder / f"{variant}-{seed}")
    seconds = time.perf_counter() - start
    loaded = load_run(folder / f"{variant}-{seed}" / "checkpoints" / f"step-{steps:08d}", "cpu")
    options = DecodeOptions.from_config(loaded.config.decode, beam_size=1)
    scores = evaluate_run(loaded.model, loaded.vocab, loaded.config.data, "test", options, loaded.config.decode.batch_size,
                          loaded.config.train.max_tokens, "cpu")
    return {"variant": variant, "seed": seed, "steps": steps, "train_s": round(seconds, 1),
            "bleu": scores["bleu"], "chrf": scores["chrf"], "loss": scores["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1,2,3,4")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # variant seed folder: one run, in a fresh process
    args = parser.parse_args()
    if args.one:
        variant, seed, folder = args.one
        print(json.dumps(one_run(variant, int(seed), args.steps, Path(folder))))
        return
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in map(int, args.seeds.split(",")):
            for variant in VARIANTS:  # alternating, so that a slower stretch of the machine hits both
                out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--one", variant,
                                      str(seed), folder], capture_output=True, text=True, check=True)
                results.append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(json.dumps(results[-1]), flush=True)
    for variant in VARIANTS:
        bleu = [r["bleu"] for r in results if r["variant"] == variant]
        print(f"{variant}: BLEU {statistics.mean(bleu):.2f} ± {statistics.pstdev(bleu):.2f} over {len(bleu)} seeds")
    gaps = [a["bleu"] - b["bleu"] for a, b in zip(results[::2], results[1::2])]
    print(f"splitmix - torch, per seed: {', '.join(f'{g:+.2f}' for g in gaps)}; mean {statistics.mean(gaps):+.2f}")


if __name__ == "__main__":
    main()
