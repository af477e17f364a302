#!/usr/bin/env bash
# Fetch, on a machine with PyPI access, the wheels that scripts/gpu_check.sh needs on a GPU
# machine which has PyTorch but no network (there: Python 3.12, x86-64, manylinux):
#
#   scripts/gpu_wheels.sh .whl          # then: scripts/gpu_check.sh OUT_DIR .whl
#
# Only what such an image usually lacks: pycocotools and jsonschema with its
# dependencies.
set -euo pipefail
dest=${1:?usage: scripts/gpu_wheels.sh DEST_DIR [PYTHON_VERSION]}
version=${2:-3.12}
python=${PYTHON:-python3}
"$python" -m pip download --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  pycocotools jsonschema jsonschema-specifications referencing rpds-py
ls -1 "$dest"
