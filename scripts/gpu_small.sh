#!/usr/bin/env bash
# The small-preset runs of issues 8 and 9 on one GPU, in one device call (the preset is too big to carry back, so it
# is trained here first). Run from the repo root with $OUT set, carrying .anchors/gpt-fast and .whl (optuna wheels):
#   bash scripts/gpu_small.sh 2>&1 | tee $OUT/log.txt
# Steps run in priority order; each gets what is left of BUDGET seconds (default 560) and is skipped when too little
# is left. Everything lands in $OUT/small/ and is packed into $OUT/small.tgz at the end.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PYTHON:-python3}
R=$OUT/small
mkdir -p "$R"
t0=$(date +%s)
BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
step() {  # step NAME MIN_SECONDS CMD...: run CMD under the time left, log its exit status
  local name=$1 need=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt "$need" ]; then echo "[skip] $name: $l s left < $need s" | tee -a "$R/steps.txt"; return; fi
  local s; s=$(date +%s)
  timeout "$l" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "[done] $name rc=$rc in $(( $(date +%s) - s )) s" | tee -a "$R/steps.txt"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/machine.txt"
$PY -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> "$R/machine.txt"

if [ ! -f zoo_cache/small/manifest.json ]; then
  step train 200 $PY -m workbench zoo train small --device cuda --max-seconds "${SMALL_SECONDS:-120}"
fi
cp zoo_cache/small/manifest.json "$R/manifest.json" 2>/dev/null
grep -v " step " "$R/train.log" > "$R/train_summary.log" 2>/dev/null

# issue 8: ours vs gpt-fast on small (AR and draft k = 4, one process), which also gives the speculative-overhead ratio
step gptfast 120 $PY scripts/bench_fastpath.py --preset small --methods ar,draft --cuda-graphs --compile default \
  --num-prompts 8 --max-new-tokens 128 --repeats 3 --out "$R/gptfast"
# issue 9: the ReDrafter head for small, trained before the study (which searches redrafter)
step head 60 $PY -m workbench zoo train-head --kind redrafter --preset small --device cuda --max-seconds 40
# issue 8: study throughput, one worker, 8 prompts x 128 new tokens, graphs on (optuna from carried wheels)
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
step study 100 timeout "${STUDY_SECONDS:-120}" $PY -m studies.run --preset small --study thr --trials 1000 \
  --device cuda --cuda-graphs on --num-prompts 8 --max-new-tokens 128 --storage sqlite:////tmp/thr.db --store /tmp/thr
$PY - > "$R/study_count.txt" 2>&1 <<'EOF'
import glob, pandas as pd
fs = glob.glob("/tmp/thr/runs/**/*.parquet", recursive=True)
df = pd.concat([pd.read_parquet(f) for f in fs]) if fs else pd.DataFrame()
print("rows", len(df))
for c in ("created_at", "timestamp", "started_at", "finished_at"):
    if c in df:
        t = pd.to_datetime(df[c]); print(c, t.min(), t.max(), (t.max() - t.min()).total_seconds())
cols = [c for c in ("method", "k", "batch", "cuda_graphs", "tokens_per_s", "speedup") if c in df]
print(df[cols].to_string() if cols else df.columns.tolist())
EOF
# issue 9: redrafter on the GPU with graphs (never run there before)
for w in 1 4; do
  step "redrafter_w$w" 30 $PY -m workbench bench --preset small --method redrafter --beam-width $w --beam-length 4 \
    --cuda-graphs --num-prompts 8 --max-new-tokens 64 --json --no-store
done
# issue 8: step modes on small (speculative overhead per mode, phase ms) and parity of graphs/compile vs eager (tiny)
step speed 60 $PY scripts/gpu_fastpath.py --out "$R/fastpath" --parts speed --preset small --modes graphs,graphs+compile
step parity 40 $PY scripts/gpu_fastpath.py --out "$R/fastpath_parity" --parts parity --preset tiny
tar -czf "$OUT/small.tgz" -C "$OUT" small
echo "total $(( $(date +%s) - t0 )) s"
