#!/usr/bin/env bash
# Every GPU figure the docs report, on one CUDA machine, all at once or a step at a time:
#
#   bash benchmarks/gpu.sh [STEP...]        steps: tests suite paper train (default: all, ~25 min on an H100)
#
# tests   the CUDA tests: kernels against the explicit path, CUDA against the CPU, autocast training,
#         two processes sharing the GPU over gloo, and the loop over NCCL in a group of one
# suite   the suite (`benchmarks/run.py --device cuda`: every peer, CTranslate2 among the decoders)
# paper   `--scale paper`: base and big at ~25,000 target tokens a step, decoding 3,000 sentences
# train   `tformer train configs/base.yaml` in bf16 for $MINUTES minutes (default 10) on Multi30k;
#         prints the run's own median tokens/s, TFLOP/s and MFU
#
# Results go to $RESULTS (default gpu-results/): a log per step, JSON where the step writes some.
# Multi30k is read from $MULTI30K (default ../shared/data/multi30k); Python is $PYTHON (python3),
# with the bench extra installed (transformers, x-transformers, ctranslate2) or on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-results}
MULTI30K=${MULTI30K:-../shared/data/multi30k}
MINUTES=${MINUTES:-10}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$RESULTS"

tests() {
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_parallel.py -k "cuda or group_of_one"
}

suite() {
    "$PYTHON" benchmarks/run.py --device cuda --json "$RESULTS/suite.json"
}

paper() {
    "$PYTHON" benchmarks/run.py --device cuda --scale paper --json "$RESULTS/paper.json"
}

train() {
    rm -rf "$RESULTS/base-run"
    "$PYTHON" -m tformer_cli train configs/base.yaml --device cuda --output-dir "$RESULTS/base-run" --quiet --json \
        --set "data.dataset=$MULTI30K" --set train.precision=bf16 --set "train.max_time=$((MINUTES * 60))"
    "$PYTHON" - "$RESULTS/base-run/metrics.jsonl" <<'EOF'
import json, statistics, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if r["split"] == "train"][1:]  # the first window warms up
for key in ("tokens_per_s", "tflops", "mfu"):
    print(f"median {key}: {statistics.median(r[key] for r in steps):,.3f} over {len(steps)} logged windows")
EOF
}

for step in "${@:-tests suite paper train}"; do
    for one in $step; do
        case $one in
            tests|suite|paper|train) echo "== $one $(date -u +%H:%M:%S)"; $one 2>&1 | tee "$RESULTS/$one.log" ;;
            *) echo "unknown step $one: choose from tests suite paper train" >&2; exit 2 ;;
        esac
    done
done
