#!/usr/bin/env bash
# One GPU window, one command: what the CPU-only CI cannot measure, in about 8 minutes on one GPU.
#   tests      the tests that need CUDA (tests/pretrain/test_step_gpu_ready.py, skipped on the CI)
#   reads      host reads and CUDA syncs per training step without a row, in the real loop (goal 0)
#   r50        ResNet-50 at 224 px, bf16, channels_last, the largest batch up to 256 that fits: MoCo v2
#              and SimCLR through the engine on JPEGs decoded by the host's cores (data.backend fast)
#              and MoCo v2 with the GPU's decoder (device, device_batched), each beside its bare step,
#              and the plain supervised step: img/s, engine/bare, method/supervised, data wait per step
#   datapath   the device data path: batched decode alone against decode plus two views
#   detection  R50-FPN and R50-C4 VOC fine-tuning, ours against plain detectron2 (s/iter), and the
#              evaluation's AP on the GPU against the CPU's
#   equivalence  SimCLR on 1 GPU vs 2 GPUs (needs two; skipped with one)
# Each section runs on its own: a failed one is named in the report with its log and the next runs.
#
# Usage, on the GPU machine (no network there: run tools/gpu_wheels.sh here first and carry .whl):
#   bash tools/gpu_check.sh                 every section; the report goes on top of benchmarks/gpu.md
#   SECTIONS="r50 detection" bash tools/gpu_check.sh   some of them
#   bash tools/gpu_check.sh --dry-run       every section on the CPU at toy sizes, report in
#                                           $WORK/gpu.md (the suite runs it: tests/test_gpu_tools.py)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
WORK=${WORK:-outputs/gpu_check}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1

install_wheels() {  # what tools/gpu_wheels.sh gathered, into $WORK/site (detectron2 without its _C)
  local site=$PWD/$WORK/site
  mkdir -p "$site" || return 1
  for whl in "$WHEELS"/*.whl; do
    case $(basename "$whl") in
      sal_detectron2-*) $PY -m zipfile -e "$whl" "$site" && rm -rf "$site"/detectron2/_C*.so "$site"/tools ;;
      *) $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl" ;;
    esac || return 1
  done
  export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
}

rm -rf "$WORK" && mkdir -p "$WORK" || exit 1
if ! $PY -c "import omegaconf, detectron2, simplejpeg" 2>/dev/null; then
  [ -d "$WHEELS" ] || { echo "error: $PY lacks the project's packages and $WHEELS/ is missing (tools/gpu_wheels.sh)"; exit 1; }
  install_wheels || { echo "error: installing $WHEELS/ failed"; exit 1; }
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ $DRY = 1 ]; then
  DEVICE=cpu GPUS=0 REPORT=${REPORT:-$WORK/gpu.md}
  SECTIONS=${SECTIONS:-tests reads r50 datapath detection}
else
  DEVICE=cuda REPORT=${REPORT:-benchmarks/gpu.md}
  GPUS=$($PY -c "import torch; print(torch.cuda.device_count())") || exit 1
  [ "$GPUS" -ge 1 ] || { echo "error: no CUDA device visible to $PY"; exit 1; }
  SECTIONS=${SECTIONS:-tests reads r50 datapath detection equivalence}
fi
CORES=$(nproc)
DATA=$WORK/synthetic  # the tiny recipes' data (generated: a few seconds)
$PY -m contrastive_transfer.synthetic --out "$DATA" --preset tiny > "$WORK/synthetic.log" 2>&1 \
  || { echo "error: generating $DATA failed, see $WORK/synthetic.log"; exit 1; }

section_tests() {
  if [ $DRY = 1 ]; then  # no CUDA: the file must still collect
    $PY -m pytest -q -p no:cacheprovider --collect-only tests/pretrain/test_step_gpu_ready.py > "$WORK/tests.txt" 2>&1
    return
  fi
  $PY -m pytest -q -p no:cacheprovider tests/pretrain/test_step_gpu_ready.py tests/pretrain/test_optimizers.py \
    -m "not slow" 2>&1 | tail -n 3 | tee "$WORK/tests.txt"
  grep -q " passed" "$WORK/tests.txt" && ! grep -q "failed" "$WORK/tests.txt"
}

section_reads() {
  local recipes=tiny_mocov2,tiny_simclr
  [ $DRY = 1 ] && recipes=tiny_mocov2  # the dry run checks the script, one recipe is enough
  $PY -m benchmarks.pretraining --host-reads --device "$DEVICE" --recipes "$recipes" \
    --data-root "$DATA/imagenet/train" > "$WORK/reads.log" 2>&1
  local status=$?
  sed -n '/^| recipe/,$p' "$WORK/reads.log" > "$WORK/reads.md"
  return $status
}

section_r50() {
  local folder=$WORK/jpegs common status=0 fast=mocov2,simclr,supervised device=mocov2 backend
  if [ $DRY = 1 ]; then
    folder=$DATA/imagenet/train fast=tiny_mocov2,tiny_supervised device=tiny_mocov2  # two: the ratio to supervised
    common="--batch 4 --steps 2 --warmup 1 --log-every 1 --set=data.image_size=32 --set=data.num_workers=1"
  else
    $PY -m benchmarks.jpeg_folder "$folder" --unique 32 --images 12288 --classes 8 > "$WORK/jpegs.log" 2>&1 \
      || { echo "error: writing the JPEGs failed, see $WORK/jpegs.log"; return 1; }
    common="--batch auto --max-batch 256 --steps 10 --warmup 10 --log-every 5 --set=data.image_size=224
      --set=model.arch=resnet50 --set=model.stem=imagenet --set=train.mixed_precision=bf16
      --set=train.channels_last=true --set=data.num_workers=$((CORES - 1)) --set=data.pin_memory=true"
  fi
  for backend in fast device device_batched; do
    local recipes=$fast
    [ $backend = fast ] || recipes=$device
    # shellcheck disable=SC2086
    $PY -m benchmarks.pretraining --device "$DEVICE" --no-augmentation --data-root "$folder" --recipes "$recipes" \
      $common --set=data.backend=$backend --out "$WORK/r50_$backend.md" > "$WORK/r50_$backend.log" 2>&1 || status=1
  done
  return $status
}

section_datapath() {
  local size="--images 64 --runs 5"  # CUDA: batches of 256 (the images repeated), the decoder's own rate
  [ $DRY = 1 ] && size="--images 8 --runs 1"  # on the CPU the verdict is "not met": only the run must pass
  # shellcheck disable=SC2086
  $PY -m benchmarks.data --device "$DEVICE" --device-only $size --out "$WORK/datapath.md" > "$WORK/datapath.log" 2>&1
}

section_detection() {
  local size="--iters 100 --warmup 20"
  [ $DRY = 1 ] && size="--tiny"
  # shellcheck disable=SC2086
  $PY -m benchmarks.detection_speed --device "$DEVICE" $size --data "$DATA" --out "$WORK/detection.md" \
    > "$WORK/detection.log" 2>&1
}

section_equivalence() {
  if [ "$GPUS" -lt 2 ]; then
    echo "one GPU: the 2-GPU equivalence needs two (skipped)" | tee "$WORK/equivalence.md"
    return 0
  fi
  local name
  for name in simclr_1gpu:1 simclr_2gpu:2; do
    $PY -m torch.distributed.run --standalone --nproc_per_node "${name#*:}" -m pretrain \
      --config configs/pretrain/tiny_simclr.yaml "data.root=$DATA/imagenet/train" "train.output_dir=$WORK/${name%%:*}" \
      train.max_steps=5 train.log_every=1 train.batch_size=64 train.resume=none train.cpu=false \
      > "$WORK/${name%%:*}.log" 2>&1 || return 1
  done
  $PY tools/gpu_equivalence.py "$WORK/simclr_2gpu" "$WORK/simclr_1gpu" --rtol 1e-3 > "$WORK/equivalence.md"
}

failed=""
for section in $SECTIONS; do
  echo "== $section"
  start=$SECONDS
  "section_$section" || { echo "error: section $section failed (logs under $WORK)"; failed="$failed $section"; }
  echo "$section: $((SECONDS - start)) s" | tee -a "$WORK/seconds.txt"
done

report() {
  echo "## $(date -u +%F): \`SECTIONS=\"$SECTIONS\" bash tools/gpu_check.sh$([ $DRY = 1 ] && echo ' --dry-run')\`"
  echo
  echo "$($PY -c 'import platform, torch, torchvision
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (dry run on the CPU)"
print(f"{gpu} x {torch.cuda.device_count()}, {platform.processor() or platform.machine()} host with '"$CORES"' cores, "
      f"Python {platform.python_version()}, torch {torch.__version__}, torchvision {torchvision.__version__}")'); \
seconds per section: $(paste -sd, "$WORK/seconds.txt" | sed 's/,/, /g')."
  echo
  [ -z "$failed" ] || { echo "Sections that failed (their logs are under $WORK):$failed."; echo; }
  local part
  for part in tests:"CUDA tests" reads:"Host reads per step without a row" r50_fast:"ResNet-50, data.backend fast" \
              r50_device:"ResNet-50, data.backend device" r50_device_batched:"ResNet-50, data.backend device_batched" \
              datapath:"The device data path" \
              detection:"Detection on $DEVICE" equivalence:"1 vs 2 GPUs"; do
    for f in "$WORK/${part%%:*}".md "$WORK/${part%%:*}".txt; do
      [ -s "$f" ] || continue
      echo "### ${part#*:}"; echo
      if [ "${f##*.}" = txt ]; then echo '```'; cat "$f"; echo '```'; else grep -v '^# ' "$f"; fi
      echo
    done
  done
}
if [ $DRY = 1 ] || [ ! -f "$REPORT" ]; then
  { echo "# GPU check"; echo; report; } > "$REPORT"
else  # the newest run on top, the earlier ones kept below it
  { head -n 2 "$REPORT"; report; tail -n +3 "$REPORT"; } > "$WORK/report.md" && cp "$WORK/report.md" "$REPORT"
fi
echo "wrote $REPORT"
[ -z "$failed" ]
