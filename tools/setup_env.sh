#!/usr/bin/env bash
# Creates .venv with torch, this project (editable, with its dev extras) and detectron2.
# Called by `make setup`; safe to re-run (pip skips what is already satisfied).
#
# Environment knobs:
#   PYTHON          interpreter used to create the venv          (default: python3)
#   TORCH_PACKAGES  torch/torchvision requirement                (default: the pair on this machine's
#                   disk, torch==2.14.1 torchvision==0.29.1; falls back to the newest pair)
#   D2_GIT_URL      upstream detectron2 repository               (default: facebookresearch/detectron2)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_PACKAGES=${TORCH_PACKAGES:-"torch==2.14.1 torchvision==0.29.1"}
D2_GIT_URL=${D2_GIT_URL:-https://github.com/facebookresearch/detectron2.git}
VENV=.venv
PY=$VENV/bin/python
PIP="$PY -m pip --disable-pip-version-check"

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$PY" ]; then
  step "creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi

step "torch / torchvision"
if ! $PY -c "import torch, torchvision" 2>/dev/null; then
  # shellcheck disable=SC2086
  $PIP install $TORCH_PACKAGES || $PIP install torch torchvision
fi
$PY -c "import torch, torchvision; print('torch', torch.__version__, '| torchvision', torchvision.__version__, '| cuda', torch.cuda.is_available())"

step "this project (editable) with its dev extras"
$PIP install -e ".[dev]"

step "detectron2"
if $PY -c "import detectron2" 2>/dev/null; then
  echo "detectron2 already importable: $($PY -c 'import detectron2; print(detectron2.__file__)')"
elif command -v git >/dev/null && timeout 8 git ls-remote --heads "$D2_GIT_URL" >/dev/null 2>&1; then
  # The upstream route. Build isolation would hide torch from detectron2's setup.py (detectron2#5501).
  echo "git host reachable: building detectron2 from $D2_GIT_URL"
  $PIP install --no-build-isolation "git+$D2_GIT_URL"
else
  echo "git host unreachable: installing the pure-Python part of sal-detectron2 from PyPI"
  "$PY" tools/install_detectron2_pypi.py
fi

step "check"
$PY - <<'EOF'
import detectron2, pretrain, transfer, converters  # noqa: F401
from detectron2.config import get_cfg
from detectron2.model_zoo import get_config_file
from detectron2.modeling import build_model

cfg = get_cfg()
cfg.merge_from_file(get_config_file("COCO-Detection/faster_rcnn_R_50_FPN_1x.yaml"))
cfg.MODEL.DEVICE = "cpu"
model = build_model(cfg)
print(f"detectron2 {detectron2.__version__} at {detectron2.__path__[0]}: built {type(model).__name__} "
      f"R50-FPN with {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on CPU")
EOF
