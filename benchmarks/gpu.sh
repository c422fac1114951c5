#!/usr/bin/env bash
# Every GPU figure the docs report, on one CUDA machine, all at once or a step at a time:
#
#   bash benchmarks/gpu.sh [STEP...]        steps: tests syncs profile suite paper train (default: all, ~27 min on an H100)
#                                           paper-train and paper-decode: paper's two halves, for time-limited calls;
#                                           profile-decode: profile's decoding half (~40 s);
#                                           attention: padded attention against explicit and packed (benchmarks/attention_packing.py)
#
# tests   the CUDA tests: kernels against the explicit path, CUDA against the CPU, autocast training,
#         two processes sharing the GPU over gloo, and the loop over NCCL in a group of one (on a torch
#         before 2.13, as the GPU image's 2.11, with DDP's renamed argument mapped: compat/sitecustomize.py)
# profile where a paper-scale base step's GPU time goes (benchmarks/profile_step.py): eager and compiled
#         training (one graph, and each layer compiled on its own), a greedy decoding batch a step at a
#         time and as CUDA graphs; kernel time by kind, how busy the GPU is ($PROFILE_ARGS adds options of
#         profile_step.py: --no-decode profiles training alone)
# suite   the suite (`benchmarks/run.py --device cuda`: every peer, CTranslate2 among the decoders)
# paper   `--scale paper`: base and big at ~25,000 target tokens a step, tformer eager and with
#         train.compile (the GPU default) beside it: paper-train; decoding 3,000 sentences: paper-decode.
#         $SIZES (default base,big) picks the sizes: on an H100 paper-train at base alone took 5.5 minutes
#         (2026-11-25; on 2026-11-27 compiling nn.Transformer took 4 of them, tformer's graph over 1.5;
#         the peer now compiles once, 1.5x faster on a CPU) and paper-decode at both sizes over 8, so a
#         10-minute call holds one size of each. On an H200 (2026-11-28, a cold cache) the train half at
#         base took 6.8 minutes with tformer-compile-layers added, and the memory half 2.3 after it
# syncs   where training and decoding wait for the GPU: 300 demo steps, then greedy and beam 4 over 64
#         sentences, on CUDA under torch's sync debug mode; each synchronizing call is counted by the
#         line of tformer that made it
# train   `tformer train configs/base.yaml` (bf16 and compiled: a GPU's defaults) for $MINUTES minutes (default 10) on Multi30k;
#         prints the run's own median tokens/s, TFLOP/s and MFU and its peak GPU memory; $TRAIN_SET adds a setting
#         (the run compiles, train.compile: auto; TRAIN_SET=train.compile=false: the eager run)
# train-start, train-wait   the train step detached from this call, and a later call's wait for it: a
#         device call lasts at most 10 minutes, and 10 minutes of training with the start-up does not fit
#
# The next lease (15 minutes of device time, each call at most 10; issue 34's open targets first).
# The code runs under the image's torch 2.11 (checked on a CPU on 2026-12-01: torch 2.11.0+cu130 with
# compat/ on PYTHONPATH passes the suite, test_parallel.py's slow tests included, but for two tests of
# the launcher on several machines, whose logs 2.11 words differently).
# .whl and .compile-cache are git-ignored, so a new checkout has neither: make .whl with
# `bash benchmarks/gpu_wheels.sh` (2 s), and without .compile-cache the first call compiles cold.
# Carry .whl and .compile-cache (once it exists); each call begins: python3 -m pip install -q --no-index --no-deps
# --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site RESULTS=$OUT/r
# COMPILE_CACHE_SAVE=$OUT, and after it the returned inductor.tgz.* replace .compile-cache's. Each
# variant compiled cold costs ~100 s on an H200 (the fifth lease's one graph: 97.6 s), so a call holds
# about four:
#   1. base MFU 0.40 (~5 min: compiled from a cache, or ~7 cold; packed and packed with the bf16 stream cold;
#      then packed on the bf16 stream with Triton's products timed against cuBLAS's, last: its autotuning
#      may take the call past 10 minutes, and a call cut off brings back what the variants before it
#      printed, but not the compile cache):
#      PROFILE_ARGS="--no-decode --baselines compiled,compiled-packed --experiments-compile packed
#      --bf16-stream --inductor max_autotune_gemm=true" gpu.sh profile   (timeout_s 600)
#   2. decoding (~3 min), then what time is left: SIZES=base gpu.sh paper-decode tests; then how decoding
#      scales with its batch (tformer alone, whether tformer eval's default of 256 hypotheses a batch
#      leaves the GPU idle): PAPER_DECODE_ARGS='--peers= --paper-decode-tokens 32768' gpu.sh paper-decode
#   3. a later lease: gpu.sh attention; --compile-attention explicit; PAPER_WORKLOADS=train SIZES=base
#      PAPER_PEERS=torch,tformer-compile,tformer-compile-pack gpu.sh paper-train (if packing pays:
#      train.pack_length: 128 in base.yaml and big.yaml); the real run, a lease of its own (~12 of its 15
#      minutes), in two calls, the second within 30 s of the first's end: MINUTES=10 TRAIN_SET=...
#      gpu.sh train-start train-wait (timeout_s 600), then gpu.sh train-wait; its data does not travel from
#      ../shared: cp -r ../shared/data/multi30k .multi30k (9 MB, git-ignored), carry it, MULTI30K=.multi30k;
#      SIZES=big paper-train and paper-decode
#
# Results go to $RESULTS (default gpu-results/): a log per step, JSON where the step writes some
# (written after every workload and size, so a step cut off by a time limit keeps what it finished).
# Multi30k is read from $MULTI30K (default ../shared/data/multi30k); Python is $PYTHON (python3),
# with the bench extra installed (transformers, x-transformers, ctranslate2) or on PYTHONPATH. On a
# machine without internet, carry the wheels that `bash benchmarks/gpu_wheels.sh` fetches (its header
# says how to install them there); the data travels in a folder named in $MULTI30K.
# (ctranslate2 4.8's CUDA build loads libcublas.so.12: on a CUDA 13 machine it is skipped.)
#
# Compiled kernels travel from one lease to the next: torch.compile's cache (inductor's graphs and
# Triton's kernels) lives in $COMPILE_CACHE_DIR, which starts from the tarball $COMPILE_CACHE (default
# .compile-cache/inductor.tgz, git-ignored, in parts .0, .1, ...) where it is there and the folder is
# not, and is packed again after every step into the folder $COMPILE_CACHE_SAVE where that is set (a
# device call: $OUT; parts of 15 MiB, as many as the cache needs). The cache hits on the same kind of
# GPU with the same torch and Triton, from any checkout path; a hit leaves dynamo's tracing and loading
# (on a CPU a small model's compiling fell from 23.5 to 2.4 s, also with the repository moved). Warm-up
# figures on a warm cache are not what a user's first compiled run waits: each step's log begins with
# the cache's state. Keep what a call returns for the next: cp FILES_AT/inductor.tgz.* .compile-cache/
# (after rm .compile-cache/inductor.tgz.*), and name .compile-cache in the call's carry.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-results}
MULTI30K=${MULTI30K:-../shared/data/multi30k}
MINUTES=${MINUTES:-10}
SIZES=${SIZES:-base,big}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${COMPILE_CACHE_DIR:-/tmp/tformer-compile-cache}
COMPILE_CACHE=${COMPILE_CACHE:-.compile-cache/inductor.tgz}
mkdir -p "$RESULTS"

cache-restore() {  # a set of parts that does not unpack (one left behind by a call) is a cold start, not a failed step
    if [[ -d $TORCHINDUCTOR_CACHE_DIR ]]; then
        echo "compile cache: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1) left by an earlier step or call on this machine"
    elif compgen -G "$COMPILE_CACHE.*" > /dev/null; then
        mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
        if cat "$COMPILE_CACHE".* | tar -xzf - -C "$TORCHINDUCTOR_CACHE_DIR"; then
            echo "compile cache: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1) restored from $COMPILE_CACHE.*"
        else
            rm -rf "$TORCHINDUCTOR_CACHE_DIR"
            echo "compile cache: cold ($COMPILE_CACHE.* did not unpack: a part missing or cut short?)"
        fi
    else
        echo "compile cache: cold (no $COMPILE_CACHE.*)"
    fi
}
# A call brings back 64 MiB of files and carries 64 MiB with the wheels and the data: a packed cache
# over $COMPILE_CACHE_MAX MiB (default 40) is not saved, as its parts could not all come back.
cache-save() {  # the parts written under new names, then renamed: a call cut off mid-write leaves the last whole set
    [[ -n ${COMPILE_CACHE_SAVE:-} && -d $TORCHINDUCTOR_CACHE_DIR ]] || return 0
    local packed bytes
    packed=$(mktemp)
    tar -czf "$packed" -C "$TORCHINDUCTOR_CACHE_DIR" .
    bytes=$(stat -c %s "$packed")
    if (( bytes > ${COMPILE_CACHE_MAX:-40} << 20 )); then
        echo "compile cache: $(( (bytes >> 20) + 1 )) MiB packed, over COMPILE_CACHE_MAX=${COMPILE_CACHE_MAX:-40}: not saved" >&2
    else
        mkdir -p "$COMPILE_CACHE_SAVE"
        split -b 15M -d -a 1 "$packed" "$COMPILE_CACHE_SAVE/inductor.tgz.new."
        rm -f "$COMPILE_CACHE_SAVE"/inductor.tgz.[0-9]
        for part in "$COMPILE_CACHE_SAVE"/inductor.tgz.new.*; do mv "$part" "${part/.new/}"; done
    fi
    rm -f "$packed"
}

tests() {
    local compat=""  # a torch older than tformer's range: DDP's forward_sync_buffers mapped (compat/sitecustomize.py)
    "$PYTHON" -c "import inspect, sys, torch.nn.parallel as p
sys.exit('forward_sync_buffers' not in inspect.signature(p.DistributedDataParallel.__init__).parameters)" \
        || compat="$PWD/benchmarks/compat:"
    # the test that compiles (bf16-auto: minutes on a GPU) last, so that a call's time limit cuts the least
    local run=("$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_parallel.py)
    local failed=0
    PYTHONPATH="$compat$PYTHONPATH" "${run[@]}" -k "(cuda or group_of_one) and not bf16-auto" || failed=1
    PYTHONPATH="$compat$PYTHONPATH" "${run[@]}" -k "cuda and bf16-auto" || failed=1
    return $failed
}

suite() {
    "$PYTHON" benchmarks/run.py --device cuda --json "$RESULTS/suite.json"
}

# The peers train with fused AdamW only (their best; $PEER_ADAMW=both adds plain AdamW, twice the time);
# $PAPER_PEERS replaces the list (each compiled system compiles for minutes, in the memory probes again),
# and $PAPER_WORKLOADS=train or memory runs one half (at base on an H100 each half takes minutes).
paper-train() {
    local workloads=${PAPER_WORKLOADS:-train,memory}
    "$PYTHON" benchmarks/run.py --device cuda --scale paper --workloads "$workloads" --sizes "$SIZES" \
        --json "$RESULTS/paper-${workloads/,/-}-${SIZES/,/-}.json" \
        --peers "${PAPER_PEERS:-torch,marian,xtransformers,xtransformers-flash,tformer-compile}" \
        --peer-adamw "${PEER_ADAMW:-fused}"
}
# Decoding 3,000 sentences takes seconds to minutes a system, so it gets 3 timed repetitions, and the
# peers its target names (Hugging Face generate) and CTranslate2, not nn.Transformer's uncached loop.
# $PAPER_DECODE_ARGS adds options of run.py, e.g. --peers= --paper-decode-tokens 32768 (tformer alone,
# in batches of 4x the hypothesis tokens of tformer eval --max-tokens 8192)
paper-decode() {
    local tokens
    tokens=$(sed -n 's/.*--paper-decode-tokens \([0-9]*\).*/-\1/p' <<< "${PAPER_DECODE_ARGS:-}")
    "$PYTHON" benchmarks/run.py --device cuda --scale paper --workloads greedy,beam --sizes "$SIZES" \
        --json "$RESULTS/paper-decode-${SIZES/,/-}$tokens.json" --peers marian,ct2,ct2-int8 --repeats 3 --warmup 1 \
        ${PAPER_DECODE_ARGS:-}
}
paper() { paper-train; paper-decode; }

profile() {  # $PROFILE_ARGS: more of profile_step.py's options, e.g. --no-decode (training alone)
    "$PYTHON" benchmarks/profile_step.py --device cuda ${PROFILE_ARGS:-}
}
attention() {  # what packing sentences would save of a step's attention (benchmarks/attention_packing.py)
    "$PYTHON" benchmarks/attention_packing.py --device cuda ${ATTENTION_ARGS:-}
}
profile-decode() {
    "$PYTHON" benchmarks/profile_step.py --device cuda --no-train
}

syncs() {
    "$PYTHON" - "$RESULTS/syncs-run" <<'EOF'
import collections, shutil, sys, traceback, warnings
from pathlib import Path
import torch
from tformer_cli.config import load_config
from tformer_cli.train import train
shutil.rmtree(sys.argv[1], ignore_errors=True)
config = load_config("configs/demo.yaml", ["train.device=cuda", "train.max_steps=300", "train.log_every=100",
                                          "train.eval_every=1000", "train.save_every=1000"])
where = collections.Counter()
def count(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        frames = [f for f in traceback.extract_stack() if "tformer_cli" in f.filename]
        where[f"{frames[-1].filename.split('tformer_cli/')[-1]}:{frames[-1].lineno}" if frames else filename] += 1
warnings.simplefilter("always")  # every sync, not the first from each place
warnings.showwarning = count
torch.cuda.set_sync_debug_mode("warn")
train(config, Path(sys.argv[1]))
torch.cuda.set_sync_debug_mode(0)
print("training, 300 steps (a model that decodes sentences of several lengths):")
for place, times in where.most_common():
    print(f"{times:6d}  {times / 300:6.2f} a step  {place}")
from tformer_cli.data import load_pairs
from tformer_cli.decoding import DecodeOptions, translate
from tformer_cli.runtime import load_run
run = load_run(Path(sys.argv[1]), "cuda")
texts = [source for source, _ in load_pairs(config.data, config.data.validation_split)[:64]]
for beam in (1, 4):
    where.clear()
    torch.cuda.set_sync_debug_mode("warn")
    out = translate(run.model, run.vocab, texts, DecodeOptions(beam_size=beam), device="cuda")
    torch.cuda.set_sync_debug_mode(0)
    tokens = sum(len(t.outputs[0][1].tokens) for t in out)
    print(f"decoding {len(texts)} sentences, beam {beam} ({tokens} tokens out):")
    for place, times in where.most_common():
        print(f"{times:5d}  {place}")
EOF
}

train() {
    rm -rf "$RESULTS/base-run"
    "$PYTHON" -m tformer_cli train configs/base.yaml --device cuda --output-dir "$RESULTS/base-run" --quiet --json \
        --set "data.dataset=$MULTI30K" --set "train.max_time=$((MINUTES * 60))" \
        ${TRAIN_SET:+--set "$TRAIN_SET"}
    "$PYTHON" - "$RESULTS/base-run/metrics.jsonl" <<'EOF'
import json, statistics, sys
records = list(map(json.loads, open(sys.argv[1])))
steps = [r for r in records if r["split"] == "train"][1:]  # the first window warms up
for key in ("tokens_per_s", "tflops", "mfu"):
    print(f"median {key}: {statistics.median(r[key] for r in steps):,.3f} over {len(steps)} logged windows")
print(f"peak GPU memory: {max(r['gpu_peak_mib'] for r in steps):,.0f} MiB (torch's tensors, validation included)")
validations = [r for r in records if r["split"] == "validation"]
print(f"{steps[-1]['step']:,} steps in {steps[-1]['elapsed']:,.0f} s, of which {len(validations)} validations "
      f"{sum(r['seconds'] for r in validations):,.1f} s; last validation: loss {validations[-1]['loss']:.3f}, "
      f"BLEU {validations[-1].get('bleu', float('nan')):.2f}")
EOF
}

# A device call's $OUT is emptied before the next call, so the detached run keeps its folder, log and
# pid in $TRAIN_RESULTS (default /tmp/tformer-train, on the machine), and train-wait copies its log and
# metrics.jsonl into $RESULTS. A call lasts at most 10 minutes and the machine goes back 30 s after one
# ends: train-wait waits $WAIT_SECONDS (default 570) at most, and a run still going then needs another
# train-wait within those 30 s (10 minutes of training and the start-up take two).
TRAIN_RESULTS=${TRAIN_RESULTS:-/tmp/tformer-train}
train-start() {  # a new session: the device keeps it running when this call returns
    # the detached run packs no cache (this call's $OUT is gone by then): train-wait does
    rm -rf "$TRAIN_RESULTS" && mkdir -p "$TRAIN_RESULTS"
    RESULTS=$TRAIN_RESULTS MINUTES=$MINUTES MULTI30K=$MULTI30K PYTHON=$PYTHON TRAIN_SET=${TRAIN_SET:-} \
        COMPILE_CACHE_SAVE= setsid nohup bash "$SELF" train > /dev/null 2>&1 < /dev/null &
    echo $! > "$TRAIN_RESULTS/train.pid"
    echo "training for $MINUTES minutes in the background (pid $!, log $TRAIN_RESULTS/train.log);" \
        "gpu.sh train-wait waits for it"
}
train-wait() {
    local pid waited=0 log=$TRAIN_RESULTS/train.log
    if [[ ! -f $TRAIN_RESULTS/train.pid ]]; then  # a fresh machine: the one that trained went back
        echo "no run started by train-start on this machine ($TRAIN_RESULTS/train.pid): it went back, or none was" \
            "started; gpu.sh train-start train-wait starts one" >&2
        return 1
    fi
    pid=$(cat "$TRAIN_RESULTS/train.pid")
    while kill -0 "$pid" 2> /dev/null && (( waited < ${WAIT_SECONDS:-570} )); do sleep 1; waited=$((waited + 1)); done
    cp "$log" "$TRAIN_RESULTS/base-run/metrics.jsonl" "$RESULTS/" 2> /dev/null || true  # what the run has written
    if kill -0 "$pid" 2> /dev/null; then
        tail -n 5 "$log" 2> /dev/null || true
        echo "still training after this wait's $waited s: gpu.sh train-wait again, within 30 s (or the machine goes back)"
    else
        cat "$log"
    fi
}

for step in "${@:-tests syncs profile suite paper train}"; do
    for one in $step; do
        case $one in
            tests|syncs|profile|profile-decode|attention|suite|paper|paper-train|paper-decode|train)
                echo "== $one $(date -u +%H:%M:%S)"
                status=0
                { cache-restore; $one; } 2>&1 | tee "$RESULTS/$one.log" || status=$?
                cache-save  # a failed step's compiled kernels serve the next call too
                (( status == 0 )) || exit $status ;;
            train-start) $one ;;
            train-wait) $one; cache-save ;;
            *) echo "unknown step $one: choose from tests syncs profile profile-decode attention suite paper" \
                    "paper-train paper-decode train train-start train-wait" >&2; exit 2 ;;
        esac
    done
done
