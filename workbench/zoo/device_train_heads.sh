#!/usr/bin/env bash
# The GPU-machine recipe for the draft heads of a trained preset: an EAGLE and a ReDrafter head, each trained on the
# target's own greedy text (--data self) for HEAD_SECONDS with held-out evaluations, early stopping and best weights.
# Run from the repo root on the GPU machine, with $OUT set (the device tool's output folder):
#   set -o pipefail; PRESET_DIR=zoo_cache/small bash workbench/zoo/device_train_heads.sh 2>&1 | tee $OUT/heads_log.txt
# Writes $OUT/<preset>_<kind>.tar (the head folder without its checkpoint and data cache: unpack into the preset folder)
# and $OUT/<preset>_<kind>_manifest.json. A run cut short resumes with RESUME=--resume (same settings); DEVICE=cpu
# runs the same recipe on the CPU (a smoke run of this script).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PYTHON:-python3}
PRESET=${PRESET:-small}
PRESET_DIR=${PRESET_DIR:-zoo_cache/$PRESET}
rc=0
for kind in ${KINDS:-eagle redrafter}; do
  start=$(date +%s)
  $PY -m workbench zoo train-head --kind "$kind" --preset "$PRESET" --dir "$PRESET_DIR" --device "${DEVICE:-cuda}" --data self \
    --self-tokens "${SELF_TOKENS:-2000000}" --batch-size "${BATCH:-64}" --eval-windows 64 --eval-every "${EVAL_EVERY:-200}" \
    --patience "${PATIENCE:-6}" --max-seconds "${HEAD_SECONDS:-180}" ${RESUME:-} ${HEAD_ARGS:-}
  r=$?
  echo "$kind: rc=$r after $(( $(date +%s) - start )) s"
  if [ $r -eq 0 ]; then
    cp "$PRESET_DIR/$kind/manifest.json" "$OUT/${PRESET}_${kind}_manifest.json"
    tar -C "$PRESET_DIR" -cf "$OUT/${PRESET}_${kind}.tar" --exclude train_state.pt --exclude cache "$kind"
  fi
  rc=$(( rc || r ))
done
exit $rc
