#!/usr/bin/env bash
# The wheels that a CUDA machine without internet lacks for `benchmarks/gpu.sh`: tformer's own needs
# that its image does not hold (datasets and two of its needs) and the x-transformers peer (and its
# needs). Run here, where the package registries answer; the wheels go to .whl/ (git-ignored):
#
#   bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]     # the machine's Python, default 3.12
#
# and there, before gpu.sh (PYTHONPATH then holds them; gpu.sh adds the repository):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#       export PYTHONPATH=/tmp/site
#
# Each wheel is fetched without its needs (--no-deps), so the list below names them all; the image's
# torch, transformers, typer, rich, tokenizers, sacrebleu, safetensors, pyarrow and numpy are used as
# they are. CTranslate2 is left out: 43 MB, and its CUDA build needs CUDA 12's cuBLAS, which a
# CUDA 13 image lacks (gpu.sh skips it there).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.12}
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
WHEELS=(
    "datasets>=4" "dill<0.4.2" "multiprocess<0.70.20"  # tformer: datasets and what the image lacks of its needs
    "x-transformers>=2.0" einx frozendict loguru torch-einops-utils  # the x-transformers peer
)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    "${PLATFORMS[@]/#/--platform=}" -d .whl "${WHEELS[@]}"
du -sh .whl
ls .whl
