#!/usr/bin/env bash
# Gathers, where pip reaches PyPI, the wheels a GPU machine without network lacks into one folder
# (default .whl/, which git ignores) that travels with the working tree; tools/gpu_check.sh installs
# them there. For Python 3.12 on x86-64 Linux (the lent H200 machine's): the machine has torch,
# torchvision, accelerate, numpy, OpenCV, matplotlib, pytest, tabulate, portalocker, cloudpickle; it
# lacks what is fetched below. Versions are this checkout's .venv's, so both machines run the same.
#   WHEELS=DIR               where to put them (default .whl)
#   NVIMGCODEC=1             also nvidia-nvimgcodec-cu13 (25 MB: region-of-interest JPEG decoding)
# Pure-Python packages that PyPI has only as source (fvcore, antlr4) are built into wheels here
# (`pip wheel`); detectron2 is sal-detectron2's cp310 wheel, which gpu_check.sh unpacks without its
# compiled part, as tools/install_detectron2_pypi.py does here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
WHEELS=${WHEELS:-.whl}
PIP="$PY -m pip --disable-pip-version-check -q"
version() { $PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pinned() { for p in "$@"; do printf '%s==%s ' "$p" "$(version "$p")"; done; }
mkdir -p "$WHEELS"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# compiled: a cp312 build for the machine's Python
# shellcheck disable=SC2046,SC2086
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d "$WHEELS" \
  $(pinned simplejpeg pycocotools) ${NVIMGCODEC:+nvidia-nvimgcodec-cu13}
# pure Python: any wheel, built from the source where PyPI has no wheel
# shellcheck disable=SC2046
$PIP wheel --no-deps -w "$WHEELS" $(pinned omegaconf antlr4-python3-runtime fvcore iopath yacs termcolor defusedxml)
$PIP download --no-deps --only-binary=:all: --python-version 3.10 --implementation cp $PLATFORMS -d "$WHEELS" \
  "sal-detectron2==$(version sal-detectron2)"
du -sh "$WHEELS"
ls "$WHEELS"
