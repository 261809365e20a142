#!/usr/bin/env bash
# Fetches, here (where PyPI answers), the wheels that an accelerator machine lacks into .whl/ (ignored by
# git), for scripts/ops/gpu_check.sh, which installs them there when Hydra is missing. That machine runs
# CPython 3.12 on x86_64 Linux with torch 2.11 (CUDA) and has no package index.
#
#   scripts/ops/fetch_gpu_wheels.sh        # then carry .whl with the checkout and run scripts/ops/gpu_check.sh
#
# What travels: setup.cfg's install_requires that torch does not bring, with the ranges setup.cfg allows.
# The machine's image has numpy, safetensors, xxhash, tqdm, PyYAML and packaging already; all but numpy
# travel anyway (small) so a change of image costs no try. Not carried:
#   numpy        16 MB, and a second numpy ahead of the image's could break the extensions built on it;
#   tensorboard  imported only by the RUN_DIR/tensorboard sidecar process, which warns and exits without it
#                (training goes on), and it drags protobuf and grpcio along.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
# pip matches manylinux tags exactly: name each glibc level a wheel may be built for.
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux2014_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64)
WHEELS=("hydra-core>=1.3,<1.4" "omegaconf>=2.3,<2.4" "PyYAML>=5.1" "packaging"
        "safetensors>=0.4" "xxhash>=3.0" "tqdm>=4.60")

rm -rf .whl && mkdir .whl  # one version of each: two of a package stop the whole install there
for req in "${WHEELS[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: "${TARGET[@]}" -d .whl "$req" \
    || { echo "fetch_gpu_wheels.sh: no CPython 3.12 manylinux wheel for '$req'; is PyPI reachable?" >&2; exit 1; }
done
# Hydra 1.3 pins the ANTLR runtime to 4.9.*, which PyPI has only as a source archive: build it (pure Python,
# so the wheel is py3-none-any and fits 3.12).
$PY -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3"

# The install gpu_check.sh does there, with that machine's tags: fails here on a wheel it would refuse.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
$PY -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: "${TARGET[@]}" --target "$check" .whl/*.whl
ls -1 .whl
du -sh .whl
