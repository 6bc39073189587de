#!/usr/bin/env bash
# What the CPU-only CI cannot check, for a user with GPUs (1 or more; unchanged on 8):
#   1. SimCLR on 1 GPU vs 2 GPUs (NCCL, torch SyncBatchNorm), same global batch: equal losses;
#      MoCo v2 on 2 GPUs (shuffle BN across GPUs): trains with finite losses;
#   2. images/s and peak memory per GPU, fp32 vs bf16, with and without channels_last and
#      torch.compile (python -m benchmarks.pretraining --device cuda), written to benchmarks/gpu.md;
#   3. JPEGs decoded on the GPU (data.backend=device, nvJPEG): a run that trains, and the data path's
#      images/s per core and on the GPU (python -m benchmarks.data --device cuda), the batched decode
#      alone with TorchCodec's decoder and torchvision's (both, where TorchCodec is installed);
#   4. the tests that need CUDA (tests/pretrain/test_step_gpu_ready.py, skipped on the CPU-only CI).
# Sections (SECTIONS names): equivalence (1), tests (4), device (3), speed (2), run in that order (the
# data path before the long compiled runs). Each runs on its own: a failed one is reported (with its
# log) in benchmarks/gpu.md and the next one still runs, so one broken part does not cost the figures
# of the others.
# Usage: bash tools/gpu_check.sh            (after `make setup` with a CUDA build of torch)
#        SECTIONS="speed" bash tools/gpu_check.sh   (some sections only: a short lease spends its
#        minutes on what is still unmeasured; benchmarks/gpu.md then holds those sections alone)
ran() { case " $SECTIONS " in *" $1 "*) return 0 ;; esac; return 1; }
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DATA=${DATA:-datasets/synthetic}
WORK=${WORK:-outputs/gpu_check}
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$GPUS" -lt 1 ]; then echo "error: no CUDA device visible to $PY (install a CUDA build of torch)"; exit 1; fi
[ -f "$DATA/manifest.json" ] || $PY -m contrastive_transfer.synthetic --out "$DATA" --preset small || exit 1
rm -rf "$WORK" && mkdir -p "$WORK" || exit 1
run() {  # run NAME NPROC RECIPE [overrides...]
  local name=$1 nproc=$2 recipe=$3; shift 3
  $PY -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m pretrain \
    --config "configs/pretrain/$recipe.yaml" "data.root=$DATA/imagenet/train" "train.output_dir=$WORK/$name" \
    train.max_steps=5 train.log_every=1 train.batch_size=64 train.resume=none train.cpu=false "$@" > "$WORK/$name.log" 2>&1 \
    || { echo "error: $name failed, see $WORK/$name.log"; tail -n 5 "$WORK/$name.log"; return 1; }
}
section_equivalence() {
if [ "$GPUS" -ge 2 ]; then
  run simclr_1gpu 1 tiny_simclr && run simclr_2gpu 2 tiny_simclr || return 1
  $PY tools/gpu_equivalence.py "$WORK/simclr_2gpu" "$WORK/simclr_1gpu" --rtol 1e-3 | tee "$WORK/equivalence.txt" \
    || return 1
  run mocov2_2gpu 2 tiny_mocov2 || return 1
  echo "mocov2 on 2 GPUs: $(grep -c '"loss"' "$WORK/mocov2_2gpu/metrics.jsonl") finite steps logged" | tee -a "$WORK/equivalence.txt"
else
  echo "one GPU: the 2-GPU equivalence needs two (skipped)" | tee "$WORK/equivalence.txt"
fi
}
section_tests() {  # the tests that need CUDA (skipped on the CPU-only CI), with the step's other GPU-readiness tests
$PY -m pytest -q -p no:cacheprovider tests/pretrain/test_step_gpu_ready.py -m "not slow" 2>&1 | tail -n 3 | tee "$WORK/tests.txt"
grep -q " passed" "$WORK/tests.txt" && ! grep -q "failed" "$WORK/tests.txt"
}
section_speed() {
local status=0
RECIPES=${RECIPES:-tiny_mocov2,tiny_simclr}
for variant in "fp32:train.mixed_precision=no" "bf16:train.mixed_precision=bf16" \
               "bf16_nchw:train.mixed_precision=bf16 train.channels_last=false" \
               "bf16_compiled:train.mixed_precision=bf16 train.compile=true"; do
  name=${variant%%:*}; sets=""
  for kv in ${variant#*:}; do sets="$sets --set=$kv"; done
  # shellcheck disable=SC2086
  $PY -m benchmarks.pretraining --device cuda --no-augmentation --recipes "$RECIPES" --data-root "$DATA/imagenet/train" \
    --set=data.image_size=224 --set=train.batch_size=128 $sets --out "$WORK/bench_$name.md" || status=1
done
return $status
}
section_device() {
run mocov2_device 1 tiny_mocov2 data.backend=device || return 1
echo "mocov2, data.backend=device: $(grep -c '"loss"' "$WORK/mocov2_device/metrics.jsonl") finite steps logged" \
  | tee "$WORK/device.txt"
$PY -m benchmarks.data --device cuda --runs 5 --out "$WORK/data_device.md" > /dev/null
}
failed=""
SECTIONS=${SECTIONS:-equivalence tests device speed}  # the data path before the long compiled runs
for section in $SECTIONS; do
  echo "== $section"
  "section_$section" || { echo "error: section $section failed"; failed="$failed $section"; }
done
{
  echo "# GPU check"
  echo
  echo "\`SECTIONS=\"$SECTIONS\" bash tools/gpu_check.sh\` on $($PY -c 'import torch; print(torch.cuda.get_device_name())') x $GPUS, $(date -u +%F)."
  echo
  [ -z "$failed" ] || { echo "Sections that failed (their logs are under $WORK):$failed."; echo; }
  if ran equivalence; then echo "## Equivalence"; echo; echo '```'; cat "$WORK/equivalence.txt" 2>/dev/null; echo '```'; fi
  if ran tests; then echo; echo "## CUDA tests"; echo; echo '```'; cat "$WORK/tests.txt" 2>/dev/null; echo '```'; fi
  if ran speed; then
    for f in "$WORK"/bench_*.md; do [ -f "$f" ] || continue; echo; echo "## $(basename "$f" .md)"; tail -n +2 "$f"; done
  fi
  if ran device; then
    echo; echo "## Decode on the GPU (data.backend=device)"; echo
    cat "$WORK/device.txt" 2>/dev/null; [ -f "$WORK/data_device.md" ] && tail -n +2 "$WORK/data_device.md"
  fi
} > benchmarks/gpu.md
echo "wrote benchmarks/gpu.md"
[ -z "$failed" ]
