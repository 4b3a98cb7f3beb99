#!/usr/bin/env bash
# One GPU device call: the steps behind one group of figures on BENCHMARKS.md, named by PART (the call name the
# figures cite; their raw outputs are docs/gpu_runs/<date>/<part>/). See scripts/README.md.
#   OUT=/path/to/out PART=n17 bash scripts/gpu_session.sh 2>&1 | tee $OUT/log.txt
# Parts:
#   defaults       bench with no speed flags against the flag combinations, tiny then small (BENCHMARKS 0)
#   gptfast        ours beside gpt-fast: tiny (AR, draft model), random 1.45 B, small with overlapped steps
#   rc2, rc3       AR decode against the HBM floor (bf16 dense GEMV, fp8) at 6.7 B and 1.45 B; rc3 also GPU parity
#   n              int8 at 6.7 B
#   n15, n16, n17  int4 at 6.7 B / 1.45 B (float and quantized LM head); n16 also int4's quality on small
#   n11            the quantized LM head's quality on small
#   m4             6.7 B n-gram verify steps per int4 kernel
#   formats        KV-cache formats (kernel parity, decode speed); small's weight-format quality grid
#   e1, f4, e5     speculative chains against AR at batch 1 (small; small with the compiled prefill; tiny)
#   u              batch sweep on small
#   trees          trees and beams (EAGLE-2, ReDrafter) against chains and AR on small
#   treesteps      ms per target step of AR, n-gram, eagle, redrafter and a bare 17-node tree verify at the random
#                  Llama-3.1-8B shape, then on tiny; batch 1, 4, 16, 32 (issue 40's goals)
#   treesmall      the same on small (with the draft-model chain), then bench_trees' batch sweep on small (tokens/s
#                  of eagle and redrafter against AR per batch: where the tree stops paying)
#   trees40        issue 40's closing figures: verify width at the 8B shape, step costs there (batch 1), tiny end to end
#                  with bench_trees, then trees served under load on tiny (gpu_serving_trees.py)
#   heads41        issue 41 on small: EAGLE-3, EAGLE and ReDrafter heads trained on the target's own text (--data self,
#                  held-out curve, early stop), then bench_trees at batch 1 with AR and the draft-model chain beside them
#                  (each head costs ~30 s over its budget, small's training 186 s: run with SMALL_SECONDS=100 BUDGET=570)
#   treestiny      issue 40's ReDrafter crash check on tiny (the committed heads), the 8B step costs with eagle3,
#                  then tiny's EAGLE and ReDrafter heads
#                  retrained on the GPU (issue 41; tars with the held-out windows), then tiny again with the new heads
#   serve43        issue 43: `workbench serve` over HTTP against in-process serve-bench on small (carry .whl with the
#                  server's wheels and optuna's), the soak on small, then the launch study's rank check on tiny (NO_RANK=1: not)
#   treesload      issue 40 after the captured tree step: tiny end to end again (the ReDrafter row crashed before), then
#                  small at batch 1, and trees served under load on small (graphs on, compile off: warm-ups in seconds;
#                  SERVING_S=200 leaves time for small's step costs with compile on)
#   short          when device time is short (one call after a late start): ReDrafter's parity on tiny, then
#                  `workbench serve` against in-process on small (run with SMALL_SECONDS=60), then small's step costs
#   tiny40         issue 40 without training (a late start): ReDrafter's parity and step costs on tiny, then hot8b's
#                  steps
#   hot8b          issue 40 at the Llama-3.1-8B shape (warm machine): EAGLE-2 with a hot vocabulary (FR-Spec, 32k)
#                  beside EAGLE-2, EAGLE-3 (32k), the bare 17-node tree verify and AR, batch 1
#   treeparity     the ReDrafter bf16 divergence on tiny: two identical runs per engine setting changed one at a time
#   fixcheck       the tree-step fixes on the GPU in one call: ReDrafter parity on tiny, step costs on tiny and small
#                  after the op cuts, `workbench serve` against in-process on small (run with SMALL_SECONDS=60)
#   last           ReDrafter's hot vocabulary at the 8B shape, then the HTTP comparison (2 rounds)
#   http           issue 43's HTTP comparison alone: both `workbench serve` modes against in-process on small
#   next           issues 40 and 43 after 2026-12-07: HTTP against in-process on small (SMALL_SECONDS=40), tiny's step
#                  costs with compile on, the 8B step with a 16k hot vocabulary, then with compile on
#   fixcheck2      fixcheck's sequel on the warm machine: hot8b's steps, trees under load on small, small's step
#                  costs with compile on
#   sweep8b        issue 40 at the Llama-3.1-8B shape: the 17-row verify's kernels against AR's (gpu_verify_width
#                  --profile), then tree and beam steps against AR at batch 1, 4, 16, 32 (compile off)
#   attn40         issue 40 after the attention launch plan change: the plan against the old one per shape, the
#                  verify width with kernels, the 8B steps with compile on (batch 1), then the 8B batch sweep
#   topk40, fused40  issue 40 after the chunked top-k (since replaced), then after the fused ranking kernel: the
#                  drafters' ranking (PyTorch ops against the kernel) per shape, tiny's step costs (compile on),
#                  tiny's tree parity, then the 8B steps with compile on
#   small40        issue 40 after the ranking kernel's chunk rule and the compiled draft glue: tiny's step costs, small
#                  (trains it and its heads): step costs at batch 1, 4, 16, 32 with compile on, then tiny's parity
#   exp40          issue 40: tiny's step costs with inductor's PDL and combo kernels off and on (kernel_tuning's
#                  inductor fields, each setting in its own process); then trains small and its heads for small40b /
#                  serve40b on the warm machine
#   small40b       issue 40 on the current code: small (trains it and its heads), step costs of AR, the draft model,
#                  EAGLE and ReDrafter at batch 1, 4, 16, 32 with compile on
#   serve40b       its sequel on the warm machine: trees served under load on small (compile off; EAGLE also with
#                  the schedule calibrated per batch size), then tiny's parity
#   tiny40c        issue 40 after the draft's D + 1 graphs: tiny's step costs and parity, the 8B steps with compile on
#                  (batch 1), then the 8B batch sweep (compile off)
#   tiny40d        tiny40c's tiny step costs again, the older code (BASE) first, 3 rounds and the profile on both
#                  sides; then tiny's bf16 parity for EAGLE and the draft model
#   q, r           study throughput on small, captured prefill on and off (in opposite orders)
#   k5             serving: the adaptive goal check with the n-gram drafter
#   k6             serving: in-flight parity on tiny, then a schedule with a threshold on small
#   k7, k9         serving: full overlap against the loop without it (n-gram; draft model)
#   k13, k14       serving: the adaptive goal check with the draft model (0.5x and 1.0x; 1.5x), 5 rounds
# Steps run in order; each gets what is left of BUDGET seconds and is skipped when too little is left. Parts that
# need the trained `small` preset train it first unless zoo_cache/small is already there (a warm machine keeps it).
# Carry .anchors/gpt-fast (PART=gptfast) and .whl (wheels the device lacks: optuna for q / r; fastapi, starlette,
# pydantic, uvicorn and opentelemetry-api for serve43) with the call.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PYTHON:-python3}
PART=${PART:?set PART to one of the parts listed at the top of scripts/gpu_session.sh}
: "${OUT:?set OUT to the folder the outputs go to}"
R=$OUT/$PART
mkdir -p "$R"
t0=$(date +%s)
BUDGET=${BUDGET:-570}
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
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
  [ -d .whl/pylib ] && export PYTHONPATH=$PYTHONPATH:$PWD/.whl/pylib  # pure-Python packages copied as is (gguf)
fi
train_small() {
  if [ ! -f zoo_cache/small/manifest.json ]; then
    echo "zoo_cache/small missing: training it" | tee -a "$R/steps.txt"
    step train 200 $PY -m workbench zoo train small --device cuda --max-seconds "${SMALL_SECONDS:-120}"
    grep -v " step " "$R/train.log" > "$R/train_summary.log" 2>/dev/null
  fi
}
floor() {  # floor STEP MIN_SECONDS CONFIG ARGS...: gpu_quant.py's floor part for one config, into $R/STEP
  local name=$1 need=$2 config=$3; shift 3
  step "$name" "$need" $PY scripts/gpu_quant.py --device cuda --out "$R/$name" --parts floor \
    --floor-configs "$config" "$@"
}
HEADS="--preset small --device cuda --data self --self-tokens ${SELF_TOKENS:-1000000} --batch-size 64 --eval-windows 64
       --eval-every 150 --patience 6"
heads() {  # the small preset's ReDrafter and EAGLE heads, trained on the device if missing (heads41's settings)
  [ -f zoo_cache/small/eagle/manifest.json ] || \
    step head_eagle 50 $PY -m workbench zoo train-head --kind eagle $HEADS --max-seconds 50
  [ -f zoo_cache/small/redrafter/manifest.json ] || \
    step head_redrafter 40 $PY -m workbench zoo train-head --kind redrafter $HEADS --max-seconds 35
}
TINY_STEPS="--device cuda --preset tiny --batches 1 --compile default --rounds 3"
steps_tiny() {  # steps_tiny [METHODS [BUDGET]]: tiny's step costs per method at batch 1, compile on (issue 40)
  step stepstiny 40 $PY scripts/gpu_tree_steps.py $TINY_STEPS --methods "${1:-ar,draft,eagle,redrafter}" \
    --out "$R/stepstiny" --budget-s "${2:-90}"
}
steps_tiny_base() {  # steps_tiny_base METHODS BUDGET: the same by the older code in BASE (a whole tree), if BASE is set
  [ -n "${BASE:-}" ] || return 0
  step stepstiny_base 40 env PYTHONPATH="$BASE" $PY "$BASE/scripts/gpu_tree_steps.py" $TINY_STEPS --methods "$1" \
    --out "$R/stepstiny_base" --budget-s "$2"
}
steps8b() {  # the Llama-3.1-8B shape: step costs with compile on at batch 1 (COMPILE_S), then the batch sweep
  step steps8b_compile 120 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --compile default \
    --out "$R/steps8b_compile" --batches 1 --methods ar,tree,eagle-hot,redrafter-hot --context 512 --steps 64 \
    --rounds 3 --budget-s "${COMPILE_S:-200}"
  step sweep8b 120 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/sweep8b" \
    --batches 1,4,16,32 --methods ar,eagle-hot,redrafter-hot,tree --context 512 --steps 64 --rounds 3 \
    --budget-s "$(( $(left) - 20 ))"
}
serving_small() {  # serving_small METHOD NEED ARGS...: gpu_serving.py on small, max_num_seqs 64, 64 warm-up requests
  local method=$1 need=$2; shift 2
  step serving "$need" $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method "$method" \
    --k 4 --max-num-seqs 64 --warmup-requests 64 "$@"
}
http_small() {  # http_small NEED ROUNDS ARGS...: `workbench serve` over HTTP against in-process serve-bench on small
  local need=$1 rounds=$2; shift 2
  step http_small "$need" $PY scripts/gpu_serve_http.py --preset small --device cuda --method draft --k 4 \
    --num-requests 128 --max-new-tokens 128 --max-num-seqs 16 --rounds "$rounds" --out "$R/serve_http_small.json" "$@"
}
C=graphs+compile+overlap  # the fast mode of every floor row

case "$PART" in
defaults)
  step tiny 240 $PY scripts/gpu_defaults.py --preset tiny --rounds 3 --out "$R/defaults_tiny.jsonl"
  train_small
  step small 150 $PY scripts/gpu_defaults.py --preset small --rounds 2 --out "$R/defaults_small.jsonl"
  ;;
gptfast)
  step tiny 120 $PY scripts/bench_fastpath.py --preset tiny --methods ar,draft --cuda-graphs --compile default \
    --out "$R/tiny"
  step r145 120 $PY scripts/bench_fastpath.py --random-config 1.45b --cuda-graphs --compile default --out "$R/r145"
  train_small
  step small 80 $PY scripts/bench_fastpath.py --preset small --methods ar --cuda-graphs --compile default \
    --overlap --num-prompts 8 --max-new-tokens 128 --repeats 3 --out "$R/small" ;;
rc2|rc3)
  floor quant67 60 6.7b --formats "none@$C,dense-triton+glo+pdl@$C,fp8-triton+all+pdl@$C"
  floor quant145 40 1.45b --formats "none@$C,dense-triton+all+pdl@$C,fp8-triton+all+pdl@$C"
  [ "$PART" = rc3 ] && step parity 60 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny ;;
n)
  floor quant67 120 6.7b --formats "none@$C,int8-triton+glu@$C" ;;
n15)
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl+qh@$C,int4-triton+all+pdl+qh@$C"
  floor ar145 30 1.45b --formats "none@$C,int4-triton+all+pdl+qh@$C" ;;
n16)
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+qh@$C"
  train_small
  step grid 80 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none,int4 --grid-quant-kernels triton --repeats 3 ;;
n17)
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+qh@$C"
  floor ar145 30 1.45b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+qh@$C" ;;
n11)
  train_small
  step grid 100 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none,int4 --grid-quant-kernels triton --grid-quant-head 0,1 --repeats 3 ;;
m4)
  # random weights accept nothing, so every n-gram step is one 5-row verify: ms per token = the verify step's time
  floor ngram67 60 6.7b --floor-ngram 4 --formats "none@$C,int4@$C,int4-triton+all+pdl@$C,int4-triton+pdl@$C" ;;
formats)
  step kvquant 60 $PY scripts/gpu_kvquant.py --device cuda --out "$R/kvquant"
  train_small
  step quant 120 $PY scripts/gpu_quant.py --device cuda --out "$R/quant" --preset small \
    --formats none,int8,int4,fp8 --grid-targets none,int8,int4-awq,fp8 --grid-drafts none,int4 --repeats 3 ;;
e1)
  train_small
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small \
    --modes "$C" --methods ar,ngram:4,draft:4,ngram:2 --repeats 5 ;;
f4)
  train_small
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small --modes "$C,$C+cprefill" \
    --methods ar,ngram:4,ngram:2 --repeats 5 ;;
e5)
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset tiny \
    --modes "$C,$C+cprefill" --methods ar,ngram:4 --repeats 3 ;;
u)
  train_small
  step sweep 90 $PY scripts/gpu_fastpath.py --out "$R/sweep" --parts sweep --preset small --sweep-mode graphs+overlap \
    --batches 1,2,4,8,16,32,64 --repeats 3 ;;
trees)
  train_small
  heads
  step trees 60 $PY scripts/bench_trees.py --preset small --device cuda --out "$R/trees" --batches 1 \
    --tree-budgets 16,32 --tree-topk 8 --beam-widths 1,4 --category-prompts 0 --budget-s "${TREES_S:-100}" ;;
treesteps)
  step steps8b 150 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b" \
    --batches 1,4,16,32 --context 512 --steps 64 --rounds 3 --budget-s "${STEPS_S:-380}"
  step stepstiny 60 $PY scripts/gpu_tree_steps.py --device cuda --preset tiny --out "$R/stepstiny" \
    --batches 1,4,16,32 --context 512 --steps 64 --rounds 3 --budget-s "$(( $(left) - 30 ))" ;;
treesmall)
  train_small
  heads
  step stepssmall 90 $PY scripts/gpu_tree_steps.py --device cuda --preset small --out "$R/stepssmall" \
    --batches 1,4,16,32 --context 512 --steps 64 --rounds 3 --budget-s "${STEPS_S:-150}"
  step sweep 60 $PY scripts/bench_trees.py --preset small --device cuda --out "$R/sweep" --batches 1,4,16,32 \
    --num-prompts 32 --max-new-tokens 64 --tree-budgets 16 --tree-depth 4 --tree-topk 4 --beam-widths 4 \
    --category-prompts 0 --repeats 3 --budget-s "$(( $(left) - 40 ))" ;;
trees40)
  step width 60 $PY scripts/gpu_verify_width.py --device cuda --widths 1,5,17 --out "$R/width"
  step steps8b 90 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b" --batches 1 \
    --context 512 --steps 64 --rounds 3 --budget-s 100
  step trees_tiny 90 $PY scripts/bench_trees.py --preset tiny --device cuda --out "$R/trees_tiny" --batches 1 \
    --num-prompts 8 --max-new-tokens 128 --tree-depth 4 --tree-topk 4 --tree-budgets 16 --beam-widths 4 \
    --beam-length 4 --category-prompts 0 --budget-s 160
  step serving_tiny 120 $PY scripts/gpu_serving_trees.py --device cuda --preset tiny \
    --methods ar,draft,ngram,eagle,redrafter --max-num-seqs 16 --num-requests 64 --max-new-tokens 64 --rates 0.5,1 \
    --repeats 3 --budget-s "$(( $(left) - 20 ))" --out "$R/serving_tiny" ;;
heads41)
  train_small
  step head_eagle3 60 $PY -m workbench zoo train-head --kind eagle3 $HEADS --draft-vocab 4096 --max-seconds "${E3_S:-80}"
  heads
  for k in eagle3 eagle redrafter; do
    [ -f "zoo_cache/small/$k/manifest.json" ] && cp "zoo_cache/small/$k/manifest.json" "$R/small_${k}_manifest.json"
  done
  step trees_small 90 $PY scripts/bench_trees.py --preset small --device cuda --out "$R/trees_small" --batches 1 \
    --num-prompts 8 --max-new-tokens 128 --tree-depth 4 --tree-topk 4 --tree-budgets 16 --eagle3-trees 5:8:32,4:4:16 \
    --beam-widths 4 --beam-length 4 --category-prompts 0 --budget-s "$(( $(left) - 25 ))" ;;
treestiny)
  T="--preset tiny --device cuda --batches 1 --num-prompts 8 --max-new-tokens 128 --tree-depth 4 --tree-topk 4
     --tree-budgets 16 --beam-widths 4 --beam-length 4 --category-prompts 0"
  step trees_tiny 90 $PY scripts/bench_trees.py $T --out "$R/trees_tiny" --budget-s 110
  step steps8b 90 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b" --batches 1 \
    --methods ar,eagle,eagle3,redrafter,tree --context 512 --steps 64 --rounds 3 --budget-s 130
  for k in eagle redrafter; do
    step "tinyhead_$k" 60 $PY -m workbench zoo train-head --kind $k --preset tiny --dir workbench/zoo/weights/tiny \
      --device cuda --data self --self-tokens "${SELF_TOKENS:-1000000}" --batch-size 64 --eval-windows 64 \
      --eval-every 200 --patience 6 --max-seconds "${TINYHEAD_S:-80}"
    [ -f "workbench/zoo/weights/tiny/$k/train_state.pt" ] && \
      tar -C workbench/zoo/weights/tiny -cf "$R/tiny_$k.tar" --exclude train_state.pt --exclude 'self_train_*' "$k"
  done
  step trees_tiny_new 60 $PY scripts/bench_trees.py $T --out "$R/trees_tiny_new" --budget-s "$(( $(left) - 15 ))" ;;
serve43)
  train_small
  http_small 120 3
  step soak_small 40 $PY scripts/server_soak.py --preset small --device cuda --requests 200 --out "$R/soak_small"
  [ -n "${NO_RANK:-}" ] || step rank_tiny 60 $PY scripts/launch_rank_check.py --preset tiny --device cuda --method ngram --ks 1,2,3,4,5,6 \
    --max-num-seqs 16 --num-requests 64 --max-new-tokens 64 --rounds 2 --out "$R/rank_tiny" ;;
treesload)
  step trees_tiny 90 $PY scripts/bench_trees.py --preset tiny --device cuda --out "$R/trees_tiny" --batches 1 \
    --num-prompts 8 --max-new-tokens 128 --tree-depth 4 --tree-topk 4 --tree-budgets 16 --beam-widths 4 \
    --beam-length 4 --category-prompts 0 --budget-s 160
  train_small
  heads
  step trees_small 90 $PY scripts/bench_trees.py --preset small --device cuda --out "$R/trees_small" --batches 1 \
    --num-prompts 8 --max-new-tokens 128 --tree-depth 4 --tree-topk 4 --tree-budgets 16 --beam-widths 4 \
    --beam-length 4 --category-prompts 0 --budget-s 120
  step serving_small 120 $PY scripts/gpu_serving_trees.py --device cuda --preset small --compile off \
    --methods ar,draft,eagle,redrafter --max-num-seqs 16 --num-requests 64 --max-new-tokens 64 --rates 0.5,1 \
    --repeats 3 --budget-s "${SERVING_S:-$(( $(left) - 20 ))}" --out "$R/serving_small"
  step stepssmall_compile 60 $PY scripts/gpu_tree_steps.py --device cuda --preset small --batches 1 --compile default \
    --methods ar,draft,eagle,redrafter --rounds 3 --out "$R/stepssmall_compile" --budget-s "$(( $(left) - 15 ))" ;;
short)
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s 50
  train_small
  http_small 60 2 --parity-requests 16
  step stepssmall 60 $PY scripts/gpu_tree_steps.py --device cuda --preset small --batches 1 \
    --methods ar,draft,eagle,redrafter --rounds 3 --out "$R/stepssmall" --budget-s "$(( $(left) - 15 ))" ;;
tiny40)
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s 50
  step stepstiny 40 $PY scripts/gpu_tree_steps.py --device cuda --preset tiny --batches 1 \
    --methods ar,draft,eagle,redrafter --rounds 3 --out "$R/stepstiny" --budget-s 50
  step steps8b 90 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b" --batches 1 \
    --methods ar,eagle,eagle-hot,eagle3,tree --context 512 --steps 64 --rounds 3 --budget-s "$(( $(left) - 15 ))" ;;
hot8b)
  step steps8b 90 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b" --batches 1 \
    --methods ar,eagle,eagle-hot,eagle3,tree --context 512 --steps 64 --rounds 3 --budget-s "$(( $(left) - 15 ))" ;;
treeparity)
  # the ReDrafter bf16 divergence: two identical runs per engine setting (overlap, graphs, compile, attention), tiny
  step parity_bf16 60 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter \
    --dtypes bfloat16 --out "$R/parity" --budget-s 240
  step parity_blocking 40 env CUDA_LAUNCH_BLOCKING=1 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda \
    --methods redrafter --dtypes bfloat16 --variants default,no_overlap --out "$R/parity_blocking" --budget-s 100
  step parity_ctrl 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods eagle,redrafter \
    --dtypes float32,bfloat16 --variants default --out "$R/parity_ctrl" --budget-s "$(( $(left) - 20 ))" ;;
fixcheck)
  # the tree-step fixes on the GPU, most needed first: ReDrafter's parity (tiny), the step costs after the op cuts
  # (tiny, then small with its heads), `workbench serve` against in-process on small (carry .whl)
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s 80
  step stepstiny 40 $PY scripts/gpu_tree_steps.py --device cuda --preset tiny --batches 1 --methods ar,eagle,redrafter \
    --rounds 3 --out "$R/stepstiny" --budget-s 60
  train_small
  http_small 60 3 --parity-requests 16
  heads
  step stepssmall 60 $PY scripts/gpu_tree_steps.py --device cuda --preset small --batches 1 \
    --methods ar,draft,eagle,redrafter --rounds 3 --out "$R/stepssmall" --budget-s "$(( $(left) - 15 ))" ;;
last)
  # ReDrafter with a 32k hot vocabulary at the 8B shape (compile on), then issue 43's HTTP comparison (carry .whl)
  step steps8b_rhot 50 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --compile default \
    --out "$R/steps8b_rhot" --batches 1 --methods ar,redrafter-hot --context 512 --steps 64 --rounds 3 --budget-s 60
  train_small
  http_small 60 "${HTTP_ROUNDS:-2}" --parity-requests 16 ;;
http)
  # issue 43's HTTP comparison alone (carry .whl): both server modes against in-process on small
  train_small
  http_small 60 "${HTTP_ROUNDS:-3}" --parity-requests 16 ;;
next)
  # what issues 40 and 43 still lack after 2026-12-07, most needed first: the HTTP comparison on small after the
  # server changes, tiny's step costs with compile on beside the draft model, the 8B step with a 16k hot vocabulary,
  # then the 8B step with compile on (each shape compiles for minutes: whatever budget is left)
  train_small
  http_small 60 "${HTTP_ROUNDS:-3}" --parity-requests 16
  steps_tiny
  step steps8b_hot16k 60 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b_hot16k" \
    --batches 1 --methods ar,eagle-hot,redrafter --draft-vocab 16000 --context 512 --steps 64 --rounds 3 --budget-s 100
  step steps8b_compile 120 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --compile default \
    --out "$R/steps8b_compile" --batches 1 --methods ar,eagle-hot --context 512 --steps 64 --rounds 3 \
    --budget-s "$(( $(left) - 15 ))" ;;
fixcheck2)
  # fixcheck's sequel on the warm machine (small and its heads already there): the 8B steps with the hot vocabulary,
  # trees served under load on small, then small's step costs with compile on
  step steps8b 90 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/steps8b" --batches 1 \
    --methods ar,eagle,eagle-hot,eagle3,tree --context 512 --steps 64 --rounds 3 --budget-s "${STEPS_S:-150}"
  train_small
  heads
  step serving_small 120 $PY scripts/gpu_serving_trees.py --device cuda --preset small --compile off \
    --methods ar,draft,eagle,redrafter --max-num-seqs 16 --num-requests 64 --max-new-tokens 64 --rates 0.5,1 \
    --repeats 3 --budget-s "${SERVING_S:-220}" --out "$R/serving_small"
  step stepssmall_compile 60 $PY scripts/gpu_tree_steps.py --device cuda --preset small --batches 1 --compile default \
    --methods ar,draft,eagle,redrafter --rounds 3 --out "$R/stepssmall_compile" --budget-s "$(( $(left) - 15 ))" ;;
sweep8b)
  step width 60 $PY scripts/gpu_verify_width.py --device cuda --widths 1,5,17 --profile --out "$R/width"
  step sweep8b 120 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --out "$R/sweep8b" \
    --batches 1,4,16,32 --methods ar,eagle-hot,redrafter-hot,tree --context 512 --steps 64 --rounds 3 \
    --budget-s "$(( $(left) - 20 ))" ;;
attn40)
  step plan 60 $PY scripts/gpu_attention_plan.py --out "$R/plan.json"
  step width 40 $PY scripts/gpu_verify_width.py --device cuda --widths 1,5,17 --profile --out "$R/width"
  steps8b ;;
topk40|fused40)
  step topk 20 $PY scripts/gpu_topk.py --out "$R/topk.json"
  steps_tiny
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s 80
  step steps8b_compile 90 $PY scripts/gpu_tree_steps.py --device cuda --target-config llama8b --compile default \
    --out "$R/steps8b_compile" --batches 1 --methods ar,eagle-hot,redrafter-hot,redrafter --context 512 \
    --steps 64 --rounds 3 --budget-s "$(( $(left) - 15 ))" ;;
small40)
  steps_tiny
  train_small
  heads
  step stepssmall 90 $PY scripts/gpu_tree_steps.py --device cuda --preset small --compile default \
    --out "$R/stepssmall" --batches 1,4,16,32 --context 512 --steps 64 --rounds 3 --budget-s "$(( $(left) - 70 ))"
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle,draft \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s "$(( $(left) - 10 ))" ;;
exp40)
  # inductor's defaults, PDL, combo kernels, both (the record's default): kernel_tuning's inductor fields
  for t in "inductor_pdl=0,inductor_combo=0" "inductor_combo=0" "inductor_pdl=0" ""; do
    n=tiny_$(echo "${t:-default}" | tr -c 'a-z0-9\n' '_')
    step "$n" 50 $PY scripts/gpu_tree_steps.py --device cuda --preset tiny --batches 1 --compile default \
      --methods ar,eagle,redrafter --rounds 3 --out "$R/$n" --budget-s 80 --kernel-tuning "$t"
  done
  train_small
  heads ;;
small40b)
  train_small
  heads
  step stepssmall 90 $PY scripts/gpu_tree_steps.py --device cuda --preset small --compile default \
    --methods ar,draft,eagle,redrafter --out "$R/stepssmall" --batches 1,4,16,32 --context 512 --steps 64 \
    --rounds 3 --budget-s "$(( $(left) - 15 ))" ;;
serve40b)
  train_small
  heads
  step serving_small 120 $PY scripts/gpu_serving_trees.py --device cuda --preset small --compile off \
    --methods ar,draft,eagle,eagle+cal,redrafter --max-num-seqs 16 --num-requests 64 --max-new-tokens 64 \
    --rates 0.5,1 --repeats 3 --budget-s "${SERVING_S:-$(( $(left) - 70 ))}" --out "$R/serving_small"
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle,draft \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s "$(( $(left) - 10 ))" ;;
tiny40c)
  # issue 40 after the draft's D + 1 graphs, the scatter-free acceptance and the model's one graph per layer: tiny's
  # step costs (with BASE=DIR, older code whole, e.g. `git archive COMMIT | tar -x -C DIR`: its costs next, in the
  # same call), parity (PDL and combo kernels on), the 8B steps with compile on at batch 1, then the 8B batch sweep
  steps_tiny
  steps_tiny_base ar,draft,eagle,redrafter 90
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods redrafter,eagle,draft \
    --dtypes float32,bfloat16 --variants default --out "$R/parity" --budget-s 80
  steps8b ;;
tiny40d)
  # tiny40c's tiny check again with time enough for 3 rounds and the profile on both sides: with BASE=DIR (older code
  # whole) that code first, then this one (tiny40c ran this code first on a fresh machine: its caches were cold, its
  # warm-ups took the budget and its one AR round came out 16 % slower); then the bf16 parity tiny40c did not reach
  steps_tiny_base ar,eagle,redrafter 130
  steps_tiny ar,eagle,redrafter 130
  step parity 40 $PY scripts/gpu_tree_parity.py --preset tiny --device cuda --methods eagle,draft \
    --dtypes bfloat16,float32 --variants default --out "$R/parity" --budget-s "$(( $(left) - 10 ))" ;;
q|r)
  # both orders, one per call, so that drift cannot favour one side
  train_small
  first=on; [ "$PART" = r ] && first=off
  for p in $first $([ $first = on ] && echo off || echo on); do
    step "study_$p" 100 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-130}" \
      --prefill-graphs $p --out "$R/study_$p"
  done ;;
k5)
  train_small
  serving_small ngram 120 --num-requests 768 --rates 1.0,1.5 --repeats 5 --budget-s "${SERVING_S:-330}" ;;
k6)
  step serving_parity 40 $PY scripts/gpu_serving_parity.py --device cuda --preset tiny --out "$R/serving_parity"
  train_small
  serving_small ngram 120 --num-requests 768 --rates 1.0,1.5 --repeats 3 --k-by-batch 1-8:4,9-64:0 \
    --full-overlap-controls --budget-s "${SERVING_S:-270}" ;;
k7)
  train_small
  serving_small ngram 120 --num-requests 768 --rates 1.0,1.5 --repeats 5 --no-thresholds --k-by-batch 1-64:4 \
    --full-overlap-controls --budget-s "${SERVING_S:-260}" ;;
k9)
  train_small
  serving_small draft 120 --num-requests 512 --rates 1.0,1.5 --repeats 3 --no-thresholds --k-by-batch 1-64:4 \
    --full-overlap-controls --budget-s "${SERVING_S:-300}" ;;
k13)
  train_small
  serving_small draft 120 --num-requests 512 --rates 0.5,1.0 --repeats 5 --budget-s "${SERVING_S:-300}" ;;
k14)
  train_small
  serving_small draft 100 --num-requests 512 --rates 1.5 --repeats 5 --budget-s "${SERVING_S:-240}" ;;
*)
  echo "unknown PART=$PART: see the list at the top of scripts/gpu_session.sh" >&2; exit 2 ;;
esac
tar -czf "$OUT/$PART.tgz" -C "$OUT" "$PART"
echo "total $(( $(date +%s) - t0 )) s"
