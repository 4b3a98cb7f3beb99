#!/usr/bin/env bash
# The GPU-machine recipe for the committed tiny preset, plus a short run of the small preset's recipe.
# Run from the repo root on the GPU machine, with $OUT set (the device tool's output folder):
#   set -o pipefail; bash workbench/zoo/device_train.sh 2>&1 | tee $OUT/log.txt
# Writes $OUT/tiny.tar (the whole tiny preset folder: unpack into workbench/zoo/weights/) and
# $OUT/small_manifest.json (the short small run's manifest; its weights are discarded).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import sys, torch, transformers, tokenizers; print(sys.version.split()[0], torch.__version__, transformers.__version__, tokenizers.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
$PY -m workbench zoo train tiny --out "$WORK/tiny" --device cuda ${TINY_ARGS:-}
rc_tiny=$?
[ $rc_tiny -eq 0 ] && tar -C "$WORK" -cf "$OUT/tiny.tar" tiny && ls -la "$WORK/tiny" "$WORK/tiny/target" "$OUT"
echo "tiny: rc=$rc_tiny after $(( $(date +%s) - start )) s"
$PY -m workbench zoo train small --out "$WORK/small" --device cuda --max-seconds "${SMALL_SECONDS:-45}" ${SMALL_ARGS:-}
rc_small=$?
[ -f "$WORK/small/manifest.json" ] && cp "$WORK/small/manifest.json" "$OUT/small_manifest.json"
echo "small: rc=$rc_small after $(( $(date +%s) - start )) s"
exit $(( rc_tiny != 0 || rc_small != 0 ))
