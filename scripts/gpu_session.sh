#!/usr/bin/env bash
# The GPU runs of issues 8-11 in device calls made back to back (the machine stays warm ~30 s between calls, so a
# later part finds the trained `small` preset in zoo_cache/; if it does not, it trains it again first).
# PART=s1: the first session's runs (ours vs gpt-fast on small without overlap, step modes, redrafter, parity);
# PART=a / PART=b: the second session's (BENCHMARKS.md section 8).
# PART=j: the fourth session's serving call; PART=h / i: its first two calls (dense Triton GEMV, floor, weight formats in the best mode).
# PART=m / n / o / p: the fifth session's calls (GEMV norm prologue, tensor-core int8 / fp8 tiles, the floor with them).
# PART=q / r / s: the sixth session's (captured prefill: parity and study throughput; serving scored against medians,
# then with 4x longer windows).
# PART=t: the seventh session's (serving with the prefill chunks captured, against eager prefill in the same rounds).
# PART=u / v / w: the eighth session's (the n-gram lookup on the device: speed, sweep, parity; serving with GC controls;
# n-gram overhead by draft length and n-gram serving with the threshold check; PART=x: n-gram serving up to 64 rows);
# PART=z: prepared, not run: call x again with --shape-controls (monotone against free schedules, same rounds; with
# the sticky default its adaptive setting is now sticky and the control monotone). PART=zs: the same on tiny (call y).
# PART=pdl1..pdl4: the ninth session's calls (dependent launches, BENCHMARKS.md section 14).
# PART=pdl5 + zs, rc1, rc2, rc3, rc4: the tenth session's calls (BENCHMARKS.md section 16). PART=z and zs now calibrate
# with 3 runs per (batch size, k) (gpu_serving --calibration-repeats, default 3 since then): z (small) is the next one;
# PART=sp1 (prepared): the n-gram speculative overhead on small with cuBLAS against the dense Triton GEMV.
# PART=e1, z, e3, e2, e4: the eleventh session's calls (BENCHMARKS.md section 17); e5 (compiled prefill on tiny) and
# e6 (verify widths on the CUDA cores: per linear, then n-gram on small) are prepared, not run.
# PART=f1 (e6 then e5), f2 (int4 words in packed fp16), f3 (int4's new rule; prefill compiled on small), f4
# (f3's small speed part again, per-repeat tok/s): the twelfth session's calls; g1 (the K loop software-pipelined)
# and z, then g2 (int4 tiles around g1's), z2 (serving at 1.5x, longer windows) and z3 (z2's schedule on tiny after
# the sync fix; int4 above one row): the thirteenth session's; g3 (int4 above one row in K tiles of whole groups)
# and z4 (serving with unbiased calibrations, profiled): the fourteenth's; h1 (the serving loop's syncs by call site;
# int4 benches), h2 (h1 after its fixes; trains small), z5 (z4's sweep after them), h3 (serving parity on the GPU,
# the fast path's parity) and h4 (small's serving iteration profiled after the fixes): the fifteenth's; z6 (z3 again
# after them) and z7 (batched prefill against a forward per row, on small) are prepared for the next one.
# PART=k1 (h3 + z6, then trains small) and z7: the sixteenth session's first two calls; k2 (the prefill behind the
# step in flight: parity, then served against the step read first) its third; k3 (the replay's forward count) and k4
# (full overlap: parity, then served against the default) and k5 (the goal check with a calibrated schedule and its
# thresholds) are prepared for the next one. PART=k4, k5, k3: the seventeenth session's first three calls; k6 (full
# overlap as the default: parity, served against it off; a schedule with a threshold and its cliff check) its fourth.
# PART=q1 (int4 loop variants per linear, tuned, floor) k8 (k7's sweep with the per-step replay fit) and k9 (the draft
# model's full overlap, timed), k10 (int4 6.7 B profiled; the draft model's goal check): the eighteenth session's; q2 (int4's prefill
# dequantized in one kernel) and k11 (the queue rule served) are prepared for the next.
# PART=k11, q2, k12, q3: the nineteenth session's calls (BENCHMARKS.md 24); q4 (int4 prefill through the GEMV kernel)
# is prepared for the next.
# PART=m1 (int4 on the tensor cores, kernels/int4_mma.py, per linear) and m2 (int4 verifies on it: parity, small's
# draft model with an int4 target), m3 (n-gram
# verifies at 6.7 B per int4 kernel), k13 (k12's draft-model goal check, 5 rounds at 0.5x and 1.0x; not run), m4 (m3's rows
# with the prologues unfused at verify widths, then k13 at 0.5x only): the twentieth session's.
# PART=n1..n6 (one-row int4 in CUDA C++: tiles, PIPE, MINB, PERSIST, the floor): the twenty-first session's; n7 (the
# sweep with the model's fusions), n8 (small's int4 grid with and without it) and k13 are prepared for the next.
# PART=n9 (n7's sweep, then the floor with its tiles and with the LM head quantized, quant_head), n10 (PIPE 2 tiles,
# the K/V write split over heads), n11 (the quantized head's quality on small), n12 and n13 (SwiGLU in gate/up's
# epilogue): the twenty-second session's. PART=n14 (attention that writes the step's K / V, fewer splits), n15
# (the RMSNorm weights folded into int4's weights), n16 (its float-head row, its quality on small), k14 (k13's check at
# 1.5x), n17 (the float-head int4 again): the twenty-third session's.
# PART=d: the third session's first call (Triton GEMVs, a kernel profile of the floor configs).
# PART=c: what the second session built but could not run (Triton GEMVs, the de-duplicated step loop against the old
# one, the serving study, trees with the draft model's phases, a bf16 study-throughput run); prepared, not yet run.
# Run from the repo root with $OUT set, carrying .anchors/gpt-fast and .whl (optuna wheels):
#   PART=a bash scripts/gpu_session.sh 2>&1 | tee $OUT/log.txt
#   PART=b bash scripts/gpu_session.sh 2>&1 | tee $OUT/log.txt
# Steps run in priority order; each gets what is left of BUDGET seconds and is skipped when too little is left.
# Everything lands in $OUT/<part>/ and is packed into $OUT/<part>.tgz at the end.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
PY=${PYTHON:-python3}
PART=${PART:-a}
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
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  [ -d .whl/pylib ] && export PYTHONPATH=$PYTHONPATH:$PWD/.whl/pylib  # pure-Python packages copied as is (gguf)
fi
case "$PART" in d|e|f|h|i|k|l|m|n|o|p|q|q1|q2|q3|q4|m1|m2|m3|m4|n1|n2|n3|n4|n5|n6|n7|n9|n10|n12|n13|n14|n15|n16|n17|pdl1|pdl2|pdl3|pdl4|pdl5|zs|rc1|rc2|rc3|rc4|sp1|e3|e4|e5|e6|f1|f2|f3|f4|g1|g2|z3|g3|h1|h2|h3|z6|k1|k2|k3) NEEDS_SMALL=0 ;; *) NEEDS_SMALL=1 ;; esac  # l trains it after its first step
train_small() {
  if [ ! -f zoo_cache/small/manifest.json ]; then
    echo "zoo_cache/small missing: training it" | tee -a "$R/steps.txt"
    step train 200 $PY -m workbench zoo train small --device cuda --max-seconds "${SMALL_SECONDS:-120}"
    grep -v " step " "$R/train.log" > "$R/train_summary.log" 2>/dev/null
  fi
}
[ "$NEEDS_SMALL" = 1 ] && train_small
floor() {  # floor STEP MIN_SECONDS CONFIG ARGS...: gpu_quant.py's floor part for one config, into $R/STEP
  local name=$1 need=$2 config=$3; shift 3
  step "$name" "$need" $PY scripts/gpu_quant.py --device cuda --out "$R/$name" --parts floor \
    --floor-configs "$config" "$@"
}
eagle_tiny() {  # eagle_tiny STEP pdl|no-pdl [EAGER]: bench eagle on tiny (k = 4, batch 4, graphs); EAGER=1 also
  # launches eager kernels with PDL (kernels/pdl.CAPTURE_ONLY off: the behaviour before call rc4)
  step "$1" 20 env WORKBENCH_PDL_EAGER="${3:-0}" $PY -m workbench bench --preset tiny --method eagle --k 4 --batch 4 \
    --max-new-tokens 48 --num-prompts 8 --repeats 3 --cuda-graphs --graph-batch-sizes 1,2,4 --temperature 0 --"$2" \
    --no-store --json
}
syncs_tiny() {  # the serving loop's syncs by call site and its profiles on tiny at 1.5x, z2's schedule (h1, h2)
  step syncs 60 $PY scripts/gpu_serving.py --device cuda --preset tiny --out "$R/syncs" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 256 --warmup-requests 32 --rates 1.5 --repeats 0 --no-thresholds \
    --k-by-batch 1-32:4,33-64:2 --sync-sites "off,k=4,adaptive,k=2 (held out)" \
    --profile-settings "k=2 (held out),adaptive,k=4" --profile-requests 256 --budget-s "${SERVING_S:-150}"
}
int4_tiny() {  # int4_tiny [BENCH ARGS...]: an int4 target on tiny, n-gram batch 1 (our kernel with whole-group rows
  # or one group, tinygemm) and the draft model at batch 4 (ours, tinygemm): greedy parity with the same target's AR
  local spec m b kern rows
  for spec in "ngram 1 triton 1" "ngram 1 triton 0" "ngram 1 aten 1" "draft 4 triton 1" "draft 4 aten 1"; do
    read -r m b kern rows <<< "$spec"
    step "int4_${m}_b${b}_${kern}_rows${rows}" 20 env WORKBENCH_INT4_WIDE_ROWS="$rows" $PY -m workbench bench \
      --preset tiny --method "$m" --k 4 --batch "$b" --max-new-tokens 64 --num-prompts 8 --repeats 3 --cuda-graphs \
      --graph-batch-sizes "$b" --target-quant int4 --quant-kernel "$kern" --temperature 0 --no-store --json "$@"
  done
}
ngram_small() {  # ngram_small STEP QUANT_KERNEL GEMV_FUSION [ENV=VALUE...]: bench n-gram k = 4 on small, batch 1, bf16,
  # graphs + compile, 5 repeats (AR and n-gram in one process), under the given environment
  local name=$1 kern=$2 fusion=$3; shift 3
  step "$name" 40 env "$@" $PY -m workbench bench --preset small --method ngram --k 4 --batch 1 --max-new-tokens 128 \
    --num-prompts 8 --repeats 5 --cuda-graphs --graph-batch-sizes 1 --compile default --quant-kernel "$kern" \
    --gemv-fusion "$fusion" --dtype bfloat16 --temperature 0 --no-store --json
}
heads() {
  [ -f zoo_cache/small/redrafter/manifest.json ] || \
    step head_redrafter 40 $PY -m workbench zoo train-head --kind redrafter --preset small --device cuda --max-seconds 25
  [ -f zoo_cache/small/eagle/manifest.json ] || \
    step head_eagle 50 $PY -m workbench zoo train-head --kind eagle --preset small --device cuda --max-seconds 35
}

if [ "$PART" = s1 ]; then
  step gptfast 120 $PY scripts/bench_fastpath.py --preset small --methods ar,draft --cuda-graphs --compile default \
    --num-prompts 8 --max-new-tokens 128 --repeats 3 --out "$R/gptfast"
  heads
  step study 60 timeout "${STUDY_S:-120}" $PY -m studies.run --preset small --study thr --trials 1000 \
    --device cuda --cuda-graphs on --num-prompts 8 --max-new-tokens 128 --storage sqlite:////tmp/thr.db --store /tmp/thr
  $PY scripts/store_counts.py /tmp/thr > "$R/study_count.txt" 2>&1
  for w in 1 4; do
    step "redrafter_w$w" 30 $PY -m workbench bench --preset small --method redrafter --beam-width $w --beam-length 4 \
      --cuda-graphs --num-prompts 8 --max-new-tokens 64 --json --no-store
  done
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/fastpath" --parts speed --preset small --modes graphs,graphs+compile
  step parity 40 $PY scripts/gpu_fastpath.py --out "$R/fastpath_parity" --parts parity --preset tiny
elif [ "$PART" = a ]; then
  heads
  # issue 8: our AR with overlapped steps beside gpt-fast's (same process, same weights and prompts)
  step gptfast_ar 80 $PY scripts/bench_fastpath.py --preset small --methods ar --cuda-graphs --compile default \
    --overlap --num-prompts 8 --max-new-tokens 128 --repeats 3 --out "$R/gptfast_ar"
  # issue 8: step modes with and without overlap (speculative overhead), one process
  step speed 50 $PY scripts/gpu_fastpath.py --out "$R/fastpath" --parts speed --preset small \
    --modes graphs+compile,graphs+compile+overlap
  # issue 9: trees and beams against chains and AR, batch 1 and 8, per-category best beam width
  step trees 60 $PY scripts/bench_trees.py --preset small --device cuda --out "$R/trees" --budget-s "${TREES_S:-140}"
elif [ "$PART" = d ]; then
  # third session, first call (no trained preset needed): the Triton GEMVs (issue 10) and where a decode token's GPU
  # time goes at 1.45 B / 6.7 B (issue 8's floor)
  step gemv 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv" --replays ${GEMV_REPLAYS:-20}
  step profile 60 $PY scripts/gpu_fastpath.py --out "$R/profile" --parts profile --floor-configs 1.45b,6.7b \
    --floor-modes ${PROFILE_MODES:-graphs,graphs+compile} --max-new-tokens 64
elif [ "$PART" = e ]; then
  # third session, second call: weight formats compiled around the Triton GEMV custom op, with overlapped steps
  # (issue 10's goals at 6.7 B), the floor with overlapped steps (issue 8), a wider GEMV tile sweep
  floor quant 120 6.7b \
    --formats ${QUANT_FORMATS:-none,fp8-triton,int8-triton,int4} --floor-modes ${QUANT_MODES:-graphs+compile+overlap}
  step floor 120 $PY scripts/gpu_fastpath.py --out "$R/floor" --parts floor --floor-configs 6.7b,1.45b \
    --floor-modes ${FLOOR_MODES:-graphs+overlap,graphs+compile+overlap,graphs+max-autotune+overlap}
  step tune 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv" --parts tune --formats fp8,int8,int4 \
    --tune-budget-s "${TUNE_S:-100}"
elif [ "$PART" = f ]; then
  # third session, third call: the fused K/V write + tuned GEMV tiles: greedy parity of the kernel path (tiny), the
  # kernel profile and floor again, the GEMV speed table and 6.7 B decode per weight format, compiled + overlapped
  step parity 60 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
  step gemv 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv" --parts speed,decode \
    --decode-modes graphs+compile+overlap --decode-extra int4
  step floor 100 $PY scripts/gpu_fastpath.py --out "$R/floor" --parts floor --floor-configs 6.7b,1.45b \
    --floor-modes ${FLOOR_MODES:-graphs+overlap,graphs+compile+overlap,graphs+max-autotune+overlap}
  step profile 50 $PY scripts/gpu_fastpath.py --out "$R/profile" --parts profile --floor-configs 6.7b,1.45b \
    --floor-modes graphs+compile --max-new-tokens 64
elif [ "$PART" = g ]; then
  # third session, last call: serving under load with the calibrated adaptive schedule and the thresholds +/- 1
  # (issue 11), then GGUF Q4 kept packed through the Triton GEMV (issue 10)
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" \
    --budget-s "${SERVING_S:-200}"
  step gguf 30 $PY scripts/gpu_gguf.py --device cuda --out "$R/gguf"
elif [ "$PART" = h ]; then
  # fourth session, first call (no preset): the dense bf16 Triton GEMV against cuBLAS per linear, its tiles, and in the
  # floor decode (issue 8: fewer kernels per layer); the weight formats in the best engine mode (issue 10)
  step gemv 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv" --parts parity,speed,tune --formats dense,fp8 \
    --ms 1,4 --tune-budget-s "${TUNE_S:-60}"
  floor quant 120 6.7b \
    --formats ${QUANT_FORMATS:-none,dense-triton,fp8-triton,int4} --floor-modes ${QUANT_MODES:-graphs+max-autotune+overlap}
  step floor 80 $PY scripts/gpu_fastpath.py --out "$R/floor" --parts floor --floor-configs 1.45b \
    --floor-modes ${FLOOR_MODES:-graphs+compile+overlap,graphs+compile+overlap+tgemv,graphs+max-autotune+overlap,graphs+max-autotune+overlap+tgemv}
  step profile 50 $PY scripts/gpu_fastpath.py --out "$R/profile" --parts profile --floor-configs 6.7b,1.45b \
    --floor-modes graphs+compile+tgemv --max-new-tokens 64
elif [ "$PART" = i ]; then
  # fourth session, second call (no preset): the dense GEMV with swept tiles and the fused SwiGLU + residual down
  # projection (every Triton GEMV format), parity on the GPU, the floor per format in the best mode, and the profile
  step gemv 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv" --parts parity,speed --formats dense,fp8 --ms 1
  floor quant 150 6.7b,1.45b \
    --formats ${QUANT_FORMATS:-none,dense-triton,fp8-triton,int8-triton,int4} \
    --floor-modes ${QUANT_MODES:-graphs+max-autotune+overlap}
  step profile 50 $PY scripts/gpu_fastpath.py --out "$R/profile" --parts profile --floor-configs 6.7b,1.45b \
    --floor-modes graphs+compile+tgemv --max-new-tokens 64
elif [ "$PART" = j ]; then
  # fourth session, third call (trains small first): serving under load with the loop-calibrated adaptive schedule,
  # draft prefill at join and grouped catch-up, 3 rounds per rate (issue 11)
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" \
    --budget-s "${SERVING_S:-220}"
elif [ "$PART" = k ]; then
  # fourth session, fourth call (no preset): the dense GEMV and the residual-epilogue fusion against cuBLAS / the
  # unfused GEMV, compile and max-autotune, 6.7 B and 1.45 B (issues 8 and 10)
  floor quant67 80 6.7b \
    --formats none,dense-triton,dense-triton+res,fp8-triton,fp8-triton+res \
    --floor-modes graphs+compile+overlap,graphs+max-autotune+overlap
  floor quant145 60 1.45b \
    --formats none,dense-triton,dense-triton+res --floor-modes graphs+compile+overlap,graphs+max-autotune+overlap
elif [ "$PART" = l ]; then
  # fourth session, last call: the SwiGLU prologue against the residual-only fusion in one process (6.7 B, compile),
  # then `small` trained for study throughput (issue 8) and serving after the adaptive-cost fix (issue 11)
  floor quantglu 50 6.7b \
    --formats fp8-triton+res,fp8-triton+glu,dense-triton+res,dense-triton+glu --floor-modes graphs+compile+overlap
  train_small
  step study 100 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-150}" \
    --out "$R/study"
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" \
    --budget-s "${SERVING_S:-120}"
elif [ "$PART" = m ]; then
  # fifth session, first call (no preset): GEMV parity with the RMSNorm prologue's kernel and the fp16 tensor-core
  # int8 / fp8 tiles, the tile sweep CUDA cores vs tensor cores at M = 1, then the floor with every fusion (+all:
  # no norm or add kernel between a layer's GEMVs) and with the measured tiles (+tc), 6.7 B then 1.45 B (issues 8, 10)
  step gemv 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv" --parts parity --formats dense,fp8,int8 --ms 1,4
  step tc 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tc" --parts tc --formats fp8,dense \
    --configs 6.7b,1.45b --tune-budget-s "${TC_S:-110}" --replays 10
  tiles=""; [ -s "$R/tc/gemv_tc_tiles.json" ] && tiles="--m1-tiles $R/tc/gemv_tc_tiles.json"
  C=graphs+compile+overlap; A=graphs+max-autotune+overlap
  F="none@$C,none@$A,dense-triton+glu@$C,dense-triton+all@$C,fp8-triton+glu@$C,fp8-triton+all@$C"
  [ -n "$tiles" ] && F="$F,dense-triton+all+tc@$C,fp8-triton+all+tc@$C"
  floor quant67 120 6.7b \
    --formats "$F" $tiles
  floor quant145 60 1.45b \
    --formats "$F" $tiles
elif [ "$PART" = pdl1 ]; then
  # ninth session, first call (no preset): programmatic dependent launch of our Triton kernels (kernels/pdl.py),
  # each row beside the same row without it, in one process per config
  $PY -c "import torch._inductor.config as c, triton; print('inductor pdl options:', [k for k in dir(c.triton) if 'pdl' in k.lower()], 'triton', triton.__version__)" >> "$R/machine.txt" 2>&1
  C=graphs+compile+overlap; A=graphs+max-autotune+overlap
  F="none@$C,none+pdl@$C,dense-triton+glu@$C,dense-triton+glu+pdl@$C,dense-triton+glu+pdl0@$C"
  F="$F,dense-triton+all@$C,dense-triton+all+pdl@$C,fp8-triton+all@$C,fp8-triton+all+pdl@$C"
  F="$F,int4-triton+all@$C,int4-triton+all+pdl@$C,none@$A,none+pdl@$A"
  floor quant67 150 6.7b \
    --formats "$F"
  floor quant145 60 1.45b \
    --formats "$F"
elif [ "$PART" = pdl2 ]; then
  # ninth session, second call: the GEMVs trigger dependents after their K loop (pdle = first thing, as in call pdl1),
  # attention combines in its last split (nofc = the combine launch), kernel profiles per row
  C=graphs+compile+overlap; A=graphs+max-autotune+overlap
  F="none@$C,none+pdl@$C,dense-triton+glu@$C,dense-triton+glu+nofc@$C,dense-triton+glu+pdl@$C"
  F="$F,dense-triton+glu+pdl0@$C,dense-triton+glu+pdle@$C,dense-triton+all@$C,dense-triton+all+pdl@$C"
  F="$F,dense-triton+all+pdl0@$C,fp8-triton+all@$C,fp8-triton+all+pdl@$C,fp8-triton+glu+pdl@$C"
  F="$F,int4-triton+all@$C,int4-triton+all+pdl@$C,none@$A,none+pdl@$A"
  floor quant67 200 6.7b \
    --formats "$F" --profile
  floor quant145 60 1.45b \
    --formats "$F" --profile
elif [ "$PART" = pdl3 ]; then
  # ninth session, third call: prefetch off by default (pdl2 = 2 tiles), the fused combine reads only the splits that
  # got KV tiles, "glo" = glu + o_proj's residual epilogue; pdle = the GEMVs trigger first thing
  C=graphs+compile+overlap
  F="dense-triton+glu@$C,dense-triton+glu+nofc@$C,dense-triton+glo@$C,dense-triton+glo+pdl@$C,dense-triton+glo+pdle@$C"
  F="$F,dense-triton+glo+pdl+nofc@$C,dense-triton+all@$C,dense-triton+all+pdl@$C,dense-triton+all+pdle@$C"
  F="$F,fp8-triton+all@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdle@$C,int4-triton+all@$C,int4-triton+all+pdl@$C"
  floor quant67 200 6.7b \
    --formats "$F,none@$C,none+pdl@$C" --profile
  floor quant145 60 1.45b \
    --formats "$F" --profile
elif [ "$PART" = pdl4 ]; then
  # ninth session, fourth call: the defaults after pdl1-3 (pdl on, no prefetch, combine launch): GPU parity on tiny
  # (eager vs graphs with dependent launches), every drafter through the Triton GEMVs (int8, fp32: exact) with and
  # without PDL, then the 6.7 B floor rows once more
  step parity 60 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
  for m in draft ngram eagle redrafter; do
    for p in pdl no-pdl; do
      step "bench_${m}_$p" 20 $PY -m workbench bench --preset tiny --method $m --k 4 --batch 4 --max-new-tokens 48 \
        --num-prompts 8 --repeats 1 --cuda-graphs --graph-batch-sizes 1,2,4 --target-quant int8 --quant-kernel triton \
        --dtype float32 --temperature 0 --$p --no-store --json
    done
  done
  C=graphs+compile+overlap
  floor quant67 90 6.7b \
    --formats "none@$C,none+pdl@$C,dense-triton+glo@$C,dense-triton+glo+pdl@$C,fp8-triton+all@$C,fp8-triton+all+pdl@$C"
elif [ "$PART" = pdl5 ]; then
  # prepared for the next session, not run yet: RoPE folded into the K/V write and attention's q load (on by default
  # since a short call at 6.7 B, BENCHMARKS 14.4) beside the same rows without it ("+norope"), at both sizes, then
  # GPU parity on tiny with it on (every drafter, trees included: not yet seen on a GPU)
  C=graphs+compile+overlap
  F="dense-triton+glo+pdl+norope@$C,dense-triton+glo+pdl+rope@$C,fp8-triton+all+pdl+norope@$C,fp8-triton+all+pdl+rope@$C"
  floor quant67 90 6.7b \
    --formats "none@$C,dense-triton+glo@$C,$F" --profile
  floor quant145 60 1.45b \
    --formats "dense-triton+all+pdl+norope@$C,dense-triton+all+pdl+rope@$C,$F"
  step parity 60 env WORKBENCH_FUSE_ROPE=1 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
elif [ "$PART" = rc1 ]; then
  # tenth session, second call: the floor rows again now that one compiled graph serves every layer and each row
  # compiles afresh (calls pdl1-pdl5 ran their later rows partly eager past dynamo's recompile limit), then a tile
  # sweep on 1.45 B's shapes (8-row tiles, longer K tiles, splits) and 1.45 B with the tiles it found ("+tc")
  C=graphs+compile+overlap
  floor quant67 150 6.7b \
    --formats "none@$C,dense-triton+glo+pdl@$C,dense-triton+all+pdl@$C,fp8-triton+all+pdl@$C,fp8-triton+glo+pdl@$C,int4-triton+all+pdl@$C" \
    --profile
  step tune145 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune145" --parts tune --sweep-configs 1.45b \
    --formats dense,fp8 --tune-block-n 8,16,32 --tune-block-k 256,512,1024,2048 --tune-stages 3 --tune-splits 1,2,4 \
    --tune-budget-s "${TUNE_S:-120}"
  T=$R/tune145/gemv_tune_tiles.json; [ -f "$T" ] || echo '{}' > "$T"
  floor quant145 60 1.45b \
    --m1-tiles "$T" --formats "none@$C,dense-triton+all+pdl@$C,dense-triton+all+pdl+tc@$C,dense-triton+glo+pdl@$C,dense-triton+glo+pdl+tc@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdl+tc@$C" \
    --profile
elif [ "$PART" = rc2 ]; then
  # tenth session, third call: the floor rows with the 8-row GEMV tiles as the default (quant_gemv.NARROW_TILES)
  # beside the 16-row ones ("+tile16"), then the speculative overhead on small (batch 1, k = 4) with every layer
  # compiled (call w's speed part hit dynamo's recompile limit before its first row), PDL and the RoPE fold on
  C=graphs+compile+overlap
  floor quant67 60 6.7b \
    --formats "none@$C,dense-triton+glo+pdl@$C,dense-triton+glo+pdl+tile16@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdl+tile16@$C"
  floor quant145 40 1.45b \
    --formats "none@$C,dense-triton+all+pdl@$C,dense-triton+all+pdl+tile16@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdl+tile16@$C"
  train_small
  step speed 90 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small \
    --modes graphs+compile+overlap --methods ar,ngram:4,draft:4,draft:2
elif [ "$PART" = rc3 ]; then
  # tenth session, last call: the 8-row tiles now only where 16-row ones give < 1.5 programs per SM (rc2: slower at
  # 6.7 B, faster at 1.45 B), fp8's 32-row tiles with 4 warps ("+fw4"), GPU parity on tiny with every layer compiled
  # through one graph, eagle with and without PDL again (call pdl4's one-repeat outlier)
  C=graphs+compile+overlap
  floor quant67 60 6.7b \
    --formats "none@$C,dense-triton+glo+pdl@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdl+fw4@$C"
  floor quant145 40 1.45b \
    --formats "none@$C,dense-triton+all+pdl@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdl+fw4@$C"
  step parity 60 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
  for p in pdl no-pdl pdl no-pdl; do  # (run before CAPTURE_ONLY existed: eagle_tiny's EAGER=1 reproduces it)
    eagle_tiny "bench_eagle_$p" $p
  done
elif [ "$PART" = rc4 ]; then
  # tenth session, last minutes: eagle (tiny) with PDL for captured launches only (kernels/pdl.CAPTURE_ONLY, the new
  # default), without PDL, and with PDL for eager launches too (the old behaviour, slower in pdl4 and rc3), twice each
  # in turn; then 1.45 B with and without PDL, captured only
  for i in 1 2; do
    for p in pdl no-pdl; do
      eagle_tiny "bench_eagle_${p}_$i" $p
    done
    eagle_tiny "bench_eagle_pdl-eager_$i" pdl 1
  done
  C=graphs+compile+overlap
  floor quant145 30 1.45b \
    --formats "dense-triton+all@$C,dense-triton+all+pdl@$C"
elif [ "$PART" = e1 ]; then
  # eleventh session, first call: the speculative overhead on small with no wasted overlapped step (a sequence's last
  # step read before another is launched), e2e and decode-window ratios (gpu_fastpath speed), then sp1's benches
  # (cuBLAS against the dense Triton GEMV for the 5-token verify)
  train_small
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small \
    --modes graphs+compile+overlap --methods ar,ngram:4,draft:4,ngram:2 --repeats 5
  for kern in "auto residual" "triton residual" "triton norm+glu+residual"; do
    set -- $kern
    ngram_small "bench_ngram_$1_${2//+/-}" "$1" "$2"
  done
elif [ "$PART" = e3 ]; then
  # eleventh session: int4 one-row tiles of several whole groups (quant_gemv TILE_GROUPS, the elementwise form; off by
  # default) swept per linear at 6.7 B and 1.45 B, with the word-widening (CVT_BITS 1) against the cvt form, then the
  # floor rows with the swept tiles ("+tc") beside today's default int4 tiles
  C=graphs+compile+overlap
  step tune_i4 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune_i4" --parts tune --sweep-configs 6.7b,1.45b \
    --formats int4 --tune-block-n 16,32,64 --tune-block-k 128,256,512,1024 --tune-warps 8 --tune-stages 3 \
    --tune-cvt-bits 0,1 --replays 10 --tune-budget-s "${TUNE_S:-150}"
  T=$R/tune_i4/gemv_tune_tiles.json; [ -f "$T" ] || echo '{}' > "$T"
  floor quant67 60 6.7b --m1-tiles "$T" \
    --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+tc@$C,int4-triton+glo+pdl+tc@$C" --profile
  floor quant145 40 1.45b --m1-tiles "$T" \
    --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+tc@$C"
elif [ "$PART" = e4 ]; then
  # eleventh session, last call: int4's measured tile rule as the default (quant_gemv.INT4_WIDE_TILES) against the
  # group-tiled tiles of before ("+i4g") and the per-shape sweep of call e3 ("+tc"), fusions glo and all
  C=graphs+compile+overlap
  T=docs/gpu_runs/2026-12-02d/e3/tune_i4/gemv_tune_tiles.json
  floor quant67 60 6.7b --m1-tiles "$T" --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+i4g@$C,int4-triton+glo+pdl+tc@$C,int4-triton+all+pdl@$C"
  floor quant145 40 1.45b --m1-tiles "$T" --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+i4g@$C,int4-triton+glo+pdl@$C"
elif [ "$PART" = e5 ]; then
  # eleventh session, a short last call: the captured prompt forwards compiled too (graphs.COMPILE_PREFILL, mode
  # suffix +cprefill) against captured eager ones, on tiny (committed: no training), one process
  C=graphs+compile+overlap
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset tiny \
    --modes "$C,$C+cprefill" --methods ar,ngram:4 --repeats 3
elif [ "$PART" = e6 ]; then
  # prepared in the eleventh session, not run: verify widths on the CUDA cores (quant_gemv.CUDA_ROWS_MAX, off by
  # default): per linear at M = 1, 2, 5, 9 (1.45 B and 6.7 B shapes), then n-gram k = 4 on small with the dense Triton
  # GEMV for one row only (17.3) against one to eight rows (WORKBENCH_GEMV_CUDA_ROWS=8)
  step rows 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/rows" --parts speed --configs 1.45b,6.7b \
    --formats dense,fp8 --ms 1,2,5,9 --cuda-rows 8 --replays 10
  train_small
  for rows in 0 8; do
    ngram_small "bench_ngram_triton_rows$rows" triton residual WORKBENCH_GEMV_CUDA_ROWS=$rows
  done
elif [ "$PART" = f1 ]; then
  # twelfth session, first call: e6 (verify widths on the CUDA cores) then e5 (the compiled prefill on tiny)
  PART=e6 BUDGET=$(( $(left) - 75 )) bash "$0"
  PART=e5 BUDGET=$(( $(left) - 5 )) bash "$0"
elif [ "$PART" = f2 ]; then
  # twelfth session: int4 words in packed fp16 arithmetic (quant_gemv.INT4_HALF2: two weights per instruction): the
  # PTX's parity on every decoder shape, per linear without / with it, a tile sweep with it, then the floor rows
  C=graphs+compile+overlap
  step parity 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/parity" --parts parity --configs 1.45b,6.7b \
    --formats int4 --ms 1 --int4-half2 1
  step parity2 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/parity2" --parts parity --configs 1.45b,6.7b \
    --formats int4 --ms 1 --int4-half2 2
  step speed 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/speed" --parts speed --configs 1.45b,6.7b \
    --formats int4 --ms 1 --half2-compare --replays 10
  step tune_h2 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune_h2" --parts tune --sweep-configs 6.7b,1.45b \
    --formats int4 --tune-block-n 16,32,64,128 --tune-block-k 256,512,1024 --tune-warps 8 --tune-stages 3 \
    --tune-half2 1,2 --replays 10 --tune-budget-s "${TUNE_S:-170}"
  T=$R/tune_h2/gemv_tune_tiles.json; [ -f "$T" ] || echo '{}' > "$T"
  floor quant67 60 6.7b --m1-tiles "$T" \
    --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+h2@$C,int4-triton+glo+pdl+h2w@$C,int4-triton+glo+pdl+h2+tc@$C" --profile
  floor quant145 40 1.45b --m1-tiles "$T" \
    --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+h2@$C,int4-triton+all+pdl+h2w@$C,int4-triton+all+pdl+h2+tc@$C"
elif [ "$PART" = f3 ]; then
  # twelfth session: int4's new tile rule (packed fp16 words on the wide and down shapes, from f2's sweep) against
  # e3's rule, the same tiles in fp32 words (+h20) and tinygemm (int4 = aten), with the PDL kernel variants now
  # warmed up before capture (f2 lost two rows to invalidated captures); then issue 8's speculative overhead on small
  # with the captured prefill compiled (+cprefill) against eager kernels
  C=graphs+compile+overlap
  floor quant67 60 6.7b \
    --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+i4e3@$C,int4-triton+glo+pdl+h20@$C,int4@$C" --profile
  floor quant145 40 1.45b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+i4e3@$C,int4@$C"
  train_small
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small --modes "$C,$C+cprefill" \
    --methods ar,ngram:4,ngram:2 --repeats 5
elif [ "$PART" = f4 ]; then
  # twelfth session, last call: f3's speed part on small again (the compiled prefill, now with each repeat's tok/s,
  # to find which repeat an outlier is), after e5's pair on tiny (no training)
  C=graphs+compile+overlap
  step speed_tiny 30 $PY scripts/gpu_fastpath.py --out "$R/speed_tiny" --parts speed --preset tiny \
    --modes "$C,$C+cprefill" --methods ar,ngram:4 --repeats 3
  train_small
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small --modes "$C,$C+cprefill" \
    --methods ar,ngram:4,ngram:2 --repeats 5
elif [ "$PART" = g1 ]; then
  # prepared in the twelfth session, run in the thirteenth (BENCHMARKS.md 19.1): the one-row GEMVs' K loop software-pipelined
  # (quant_gemv.LOOP_STAGES; the kernel's num_stages pipelines only loads that feed tl.dot): per linear without / with
  # 3 stages for int4, fp8 and dense, int4 tiles swept with it, then the floor rows with and without it
  C=graphs+compile+overlap
  step speed 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/speed" --parts speed --configs 1.45b,6.7b \
    --formats int4,fp8,dense --ms 1 --loop-stages-compare 3 --replays 10
  step tune_ls 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune_ls" --parts tune --sweep-configs 6.7b,1.45b \
    --formats int4 --tune-block-n 32,64,128 --tune-block-k 512,1024 --tune-warps 4,8 --tune-stages 3 \
    --tune-half2 1 --tune-loop-stages 0,2,3,4 --replays 10 --tune-budget-s "${TUNE_S:-150}"
  T=$R/tune_ls/gemv_tune_tiles.json; [ -f "$T" ] || echo '{}' > "$T"
  floor quant67 60 6.7b --m1-tiles "$T" --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+ls3@$C,\
int4-triton+glo+pdl+tc@$C,fp8-triton+all+pdl@$C,fp8-triton+all+pdl+ls3@$C"
  floor quant145 40 1.45b --m1-tiles "$T" --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+ls3@$C,\
int4-triton+all+pdl+tc@$C"
elif [ "$PART" = g2 ]; then
  # thirteenth session: call g1's sweep made 32-row int4 tiles with 4 warps the rule (INT4_WIDE_TILES True since; the
  # pipelined K loop lost everywhere): a sweep around it (2 and 4 warps, 16 and 32 rows, K tiles to 2048, packed fp16
  # words or not), then the floor with the new rule against f2's, the swept tiles and tinygemm (int4 = aten), and our
  # int4 with the engine's default fusion (+res) beside tinygemm: which one quant_kernel auto should run
  C=graphs+compile+overlap
  step tune 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune" --parts tune --sweep-configs 6.7b,1.45b \
    --formats int4 --tune-block-n 16,32 --tune-block-k 512,1024,2048 --tune-warps 2,4 --tune-stages 3 \
    --tune-half2 0,1 --replays 20 --tune-budget-s "${TUNE_S:-150}"
  T=$R/tune/gemv_tune_tiles.json; mkdir -p "$R/tune"; [ -f "$T" ] || echo '{}' > "$T"
  floor quant67 60 6.7b --m1-tiles "$T" --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+i4f2@$C,\
int4-triton+glo+pdl+tc@$C,int4-triton+res+pdl@$C,int4@$C"
  floor quant145 40 1.45b --m1-tiles "$T" --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+i4f2@$C,\
int4-triton+all+pdl+tc@$C,int4-triton+res+pdl@$C,int4@$C"
elif [ "$PART" = z2 ]; then
  # thirteenth session: serving on small at 1.5x saturation only (call z's "lt": adaptive, whose schedule is k = 4's,
  # 0.3-0.5 % below k = 4 in every round of a fixed order; call g's rotated rounds swung +-25 % with 256-request
  # windows), 3x longer windows and 5 rotated rounds, no threshold runs
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.5 --repeats 5 --no-thresholds \
    --budget-s "${SERVING_S:-250}"
elif [ "$PART" = z3 ]; then
  # thirteenth session, last call: call z2's schedule (1-32:4,33-64:2) given on tiny (no training), after the fix of
  # the per-step upload that synchronized every shortened step (BENCHMARKS.md 19.4): is adaptive now between k = 2
  # and k = 4? Then our int4 against tinygemm above one row (verify widths, a short prefill): may auto pick ours?
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset tiny --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.5 --repeats 5 --no-thresholds \
    --k-by-batch 1-32:4,33-64:2 --budget-s "${SERVING_S:-100}"
  step speed 15 $PY scripts/gpu_gemv.py --device cuda --out "$R/speed" --parts speed --configs 1.45b,6.7b \
    --formats int4 --ms 1,5,16 --replays 10
elif [ "$PART" = g3 ]; then
  # prepared in the thirteenth session, not run: int4 above one row in K tiles of whole groups on the tensor cores
  # (quant_gemv.INT4_WIDE_ROWS, off by default; its default tile, 64 x 256 with 8 warps, is a guess) against the
  # one-group tiles and tinygemm at verify and prefill widths, then its tile swept at M = 2, 5 and 9 (the rows part:
  # 32 / 64 / 128 rows x K tiles of 256 / 512 x 4 / 8 warps, each against tinygemm)
  step speed 20 $PY scripts/gpu_gemv.py --device cuda --out "$R/speed" --parts speed --configs 1.45b,6.7b \
    --formats int4 --ms 2,5,9,16,64 --int4-wide-rows-compare --replays 10
  step rows 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/rows" --parts rows --sweep-configs 6.7b,1.45b \
    --rows-ms 2,5,9 --replays 10 --tune-budget-s 150
  # (fourteenth session: greedy parity on tiny, graph modes and the overlapped loop against eager, now that every
  # per-step and per-request upload is queued without waiting for the GPU: engine.graphs.upload)
  step parity 40 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
elif [ "$PART" = z4 ]; then
  # prepared in the thirteenth session, not run (device time spent): serving on small with the calibrations no longer
  # biased toward the full length (the shortened-step sync fixed, BENCHMARKS.md 19.4), 3 rates x 3 rotated rounds of
  # 768 requests, then one profiled run each of k = 2, adaptive and k = 4 (why adaptive trailed k = 2 on tiny, 19.5)
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 0.5,1.0,1.5 --repeats 3 --no-thresholds \
    --profile-settings "k=2 (held out),adaptive,k=4" --budget-s "${SERVING_S:-330}"
elif [ "$PART" = h1 ]; then
  # fifteenth session, first call (no training): where the serving loop waits for the GPU, by call site (z4's
  # profiles: host 4.7 ms against 2.4-2.6 ms of GPU time per iteration, 6-7 cudaStreamSynchronize per iteration), on
  # tiny at 1.5x with z2's schedule, beside profiles of the same settings; then greedy parity and speed of int4 on
  # tiny with our kernel's new default above one row (INT4_WIDE_ROWS, K tiles of whole groups), the old one and tinygemm
  # (as run: without --dtype bfloat16, so every bench refused to start; h2 ran them in bf16)
  syncs_tiny
  int4_tiny
elif [ "$PART" = h2 ]; then
  # fifteenth session, second call: h1's sync count and profiles on tiny again after its fixes (the block table
  # uploaded as one image, no host scalar written into engine state, an iteration's first tokens read at once);
  # h1's int4 benches in bf16 (the int4 kernels' input type); then train small for call z5
  syncs_tiny
  int4_tiny --dtype bfloat16
  train_small
elif [ "$PART" = z5 ]; then
  # fifteenth session, right after h2 on the same machine (small trained there): z4's sweep again after h1's fixes
  # of the serving loop's host work (every setting gains; does adaptive now reach the better of off and fixed k?)
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 0.5,1.0,1.5 --repeats 3 --no-thresholds \
    --budget-s "${SERVING_S:-330}"
elif [ "$PART" = h3 ]; then
  # fifteenth session, last call: after the serving loop's fixes (the block table uploaded as one pinned image, no
  # host scalar into engine state, first tokens read at once), in-flight parity on the GPU (every request against its
  # solo greedy output: chains, an adaptive schedule, chunked prefill, prefix reuse, max_util preemption) and the
  # fast path's greedy parity (graph modes and the overlapped loop, which uploads block tables while a step runs)
  step serving_parity 40 $PY scripts/gpu_serving_parity.py --device cuda --preset tiny --out "$R/serving_parity"
  step parity 40 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
elif [ "$PART" = h4 ]; then
  # fifteenth session: where small's serving iteration spends its time after h1's fixes (z4 profiled 4.7 ms of host
  # against 2.4-2.6 ms of GPU time per iteration; z5's replay fit charges 1.4 ms per prefill forward): syncs by call
  # site and profiles of off, k = 2 and k = 4 at 1.0x saturation, no sweep
  train_small
  step syncs 60 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/syncs" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 1.0 --repeats 0 --no-thresholds \
    --k-by-batch 1-64:3 --sync-sites "off,k=4" --profile-settings "off,k=2 (held out),k=4" \
    --profile-requests 512 --budget-s "${SERVING_S:-150}"
elif [ "$PART" = z6 ]; then
  # prepared in the fifteenth session, not run (no device time left): call z3 again (z2's schedule given on tiny, 1.5x,
  # 5 rotated rounds) after the serving loop's fixes (20.3): does adaptive still trail the fixed k = 2 it runs above
  # 32 rows (19.5: 0.87-0.997)?
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset tiny --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.5 --repeats 5 --no-thresholds \
    --k-by-batch 1-32:4,33-64:2 --budget-s "${SERVING_S:-100}"
elif [ "$PART" = k1 ]; then
  # sixteenth session, first call: h3 again (serving parity on the GPU after _prefill's plan -> run -> finish reorder,
  # which the default path runs too), then z6 (tiny, z2's schedule, 1.5x, 5 rounds), then train small for call z7
  PART=h3 BUDGET=$(( $(left) - 320 )) bash "$0"
  PART=z6 BUDGET=$(( $(left) - 210 )) bash "$0"
  train_small
elif [ "$PART" = k2 ]; then
  # sixteenth session, third call: the serving loop with an iteration's prefill enqueued behind its step in flight
  # (serving.loop.OVERLAP_PREFILL, the new default) and batched prefill on by default (up to 4 rows, after z7):
  # in-flight parity on the GPU (the step is now launch_step + finish_step), greedy parity of generate with the draft
  # model and graphs, then train small and serve it with off and fixed k also run with the step read first
  # (--overlap-controls) and with a forward per prefilling row (--batch-prefill-controls 1) in every round
  step serving_parity 40 $PY scripts/gpu_serving_parity.py --device cuda --preset tiny --out "$R/serving_parity"
  step bench_draft 20 $PY -m workbench bench --preset tiny --method draft --k 4 --batch 4 --max-new-tokens 48 \
    --num-prompts 8 --repeats 2 --cuda-graphs --graph-batch-sizes 1,2,4 --temperature 0 --no-store --json
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram \
    --k 4 --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 --no-thresholds \
    --k-by-batch 1-64:3 --overlap-controls --batch-prefill-controls 1 --budget-s "${SERVING_S:-250}"
elif [ "$PART" = k3 ]; then
  # sixteenth session, last call (about 300 s of device time left): the replay against the new loop (prefill forwards
  # of up to 4 rows, counted as the loop runs them since this call; k2's replay counted one forward per chunk) on tiny,
  # z6's shape (off, k = 4, adaptive, held-out k = 2) at 1.0x and 1.5x, 2 rounds
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset tiny --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 2 --no-thresholds \
    --k-by-batch 1-32:4,33-64:2 --budget-s "${SERVING_S:-110}"
elif [ "$PART" = k4 ]; then
  # prepared in the sixteenth session, not run (no device time left): full overlap (serving.loop.FULL_OVERLAP, off by
  # default; each step launched before the previous one is read). In-flight parity on the GPU (its settings include
  # three with full overlap), then small at 1.0x and 1.5x, 3 rounds, off and k = 4 also run with full overlap
  step serving_parity 40 $PY scripts/gpu_serving_parity.py --device cuda --preset tiny --out "$R/serving_parity"
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram \
    --k 4 --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 --no-thresholds \
    --k-by-batch 1-64:4 --full-overlap-controls --budget-s "${SERVING_S:-250}"
elif [ "$PART" = k5 ]; then
  # prepared in the sixteenth session, not run: issue 11's goal check as written, with both of this session's new
  # defaults (batched prefill, the prefill behind the step in flight): the loop calibration picks the schedule on
  # small, the sweep serves it against off, fixed k and a held-out k at 1.0 and 1.5x in 5 rounds (5 of 5 on one side
  # is the fewest a sign test calls significant at 5 %), and each of the schedule's thresholds is served at t - 1, t,
  # t + 1 (the cliff check; no call has run it since the calibration found schedules without thresholds)
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram \
    --k 4 --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 5 \
    --budget-s "${SERVING_S:-330}"
elif [ "$PART" = k6 ]; then
  # seventeenth session, after k4 (full overlap 1.02-1.48x in 10 of 12 pairs) made full overlap the default where it
  # applies: in-flight parity on the GPU under the new default (three settings switch it off), then small with the
  # loop calibration's monotone schedule of k5 given (1-8:4,9-64:0: k5's sticky pick was one k for every size, so no
  # threshold to check), at 1.0x and 1.5x, 3 rounds, off and k = 4 also run without full overlap, then the cliff
  # check at the schedule's threshold (concurrency 8, 9, 10)
  step serving_parity 40 $PY scripts/gpu_serving_parity.py --device cuda --preset tiny --out "$R/serving_parity"
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram \
    --k 4 --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 \
    --k-by-batch 1-8:4,9-64:0 --full-overlap-controls --budget-s "${SERVING_S:-270}"
elif [ "$PART" = k8 ]; then
  # eighteenth session: issue 11's last check. k7's sweep (small, the loop calibration's 1-64:4 given, off, k = 4,
  # adaptive and the held-out k = 2 at 1.0x and 1.5x, 5 rounds) now that the replay also reports its per-step fit
  # (draft cost per step, not per node: replay.PER_STEP_FEATURES); no controls, so the rounds fit the budget
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram \
    --k 4 --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 5 --no-thresholds \
    --k-by-batch 1-64:4 --budget-s "${SERVING_S:-270}"
elif [ "$PART" = k9 ]; then
  # eighteenth session: full overlap with the draft model (GPU parity in k4/k6, never timed): small, draft model k = 4
  # (every step drafts, so full overlap applies), off and k = 4 also run with it switched off, 1.0x and 1.5x, 3 rounds
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method draft \
    --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 --no-thresholds \
    --k-by-batch 1-64:4 --full-overlap-controls --budget-s "${SERVING_S:-300}"
elif [ "$PART" = k10 ]; then
  # eighteenth session, last call: where the default int4 decode's time goes at 6.7 B (kernel profile of the floor
  # rows; q1's variants both lost), then issue 11's goal with the draft model, where k9 found k = 4 below off at
  # 1.0x and 1.5x: the loop calibration picks the schedule, served against off, fixed k and the held-out k, with the
  # cliff check at its thresholds
  # (the profile last: device time was short after refusals, and the goal check matters more)
  C=graphs+compile+overlap
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method draft \
    --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 \
    --budget-s "${SERVING_S:-300}"
  floor quant67 60 6.7b --formats "none@$C,int4-triton+glo+pdl@$C" --profile
elif [ "$PART" = k11 ]; then
  # prepared in the eighteenth session (no device time left): the queue rule (spec_off_queue) against k10's miss (the
  # draft model's calibrated k = 3 at 0.91x of off at 1.5x; at 1.0x k = 4 was best). Small, draft model, 1.0x and
  # 1.5x, 3 rounds, adaptive = k = 3 with no drafts while >= 4 (then >= 16) requests wait, replayed with the rule.
  # A draft model keeps full overlap only where every step drafts, so the rule forfeits it (k9: worth 1.05-1.20x):
  # off and k = 4 also run without full overlap (--full-overlap-controls), the fair comparison for the rule
  train_small
  for q in 4 16; do
    step "serving_q$q" 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving_q$q" \
      --method draft --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 \
      --no-thresholds --k-by-batch 1-64:3 --spec-off-queue "$q" --full-overlap-controls \
      --budget-s "${SERVING_S:-160}"
  done
elif [ "$PART" = k12 ]; then
  # nineteenth session: k11 found the queue rule a loss (0.66-0.80 of the best) and why the loop calibration
  # under-rated off: its k = 0 points ran the draft-model engine without full overlap (worth 1.15-1.29x to off).
  # Now a schedule that never drafts keeps full overlap, and a draft model's calibrated schedule is one k for every
  # batch size (the largest size's pick: a mixed one forfeits full overlap). The goal check with the draft model:
  # loop calibration, served against off, fixed k = 4 and the held-out k = 2, at 0.5x, 1.0x and 1.5x saturation;
  # then int4's prefill with the new default dequant against the old (+dqt) and the +all row, at 6.7 B
  C=graphs+compile+overlap
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method draft \
    --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 0.5,1.0,1.5 --repeats 3 \
    --budget-s "${SERVING_S:-280}"
  floor quant67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+dqt@$C"
elif [ "$PART" = m1 ]; then
  # twentieth session: int4 at 1..16 rows on the tensor cores (kernels/int4_mma.py: each weight dequantized in
  # registers into the MMA's A operand, about 3 instructions a weight in the SASS against 4.3 for the CUDA-core GEMV).
  # Per linear, a tile grid with parity, beside bf16, tinygemm and our GEMV: 6.7 B at 1, 5, 16 rows, 1.45 B at 1
  step mma67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/mma67" --parts mma --sweep-configs 6.7b \
    --mma-ms 1,5,16 --mma-block-n 64,128,256 --mma-warps 4,8 --mma-stages 3,4 --mma-per-sm 1,2,4 --replays 10
  step mma145 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/mma145" --parts mma --sweep-configs 1.45b \
    --mma-ms 1 --mma-block-n 64,128,256 --mma-warps 4,8 --mma-stages 3,4 --mma-per-sm 1,2,4 --replays 10
elif [ "$PART" = m2 ]; then
  # twentieth session: m1 put int4 verifies (5 and 16 rows) on the tensor cores 1.45x faster per 6.7 B layer than
  # our GEMV and 1.34x than tinygemm; quant_gemv now hands 2..16-row int4 calls to kernels/int4_mma.py. Parity of
  # every 6.7 B linear at 1-16 rows through Int4Linear; then the small preset's draft model k = 4 with an int4 target,
  # tinygemm ("aten") against ours ("triton", verifies on the tensor cores), and ours with the old verify (+mma0)
  train_small
  step parity 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/parity" --parts parity --configs 6.7b,1.45b \
    --formats int4 --ms 1,2,5,9,16
  step grid 100 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none,int4 --grid-quant-kernels aten,triton --repeats 3
  step grid_mma0 60 env WORKBENCH_INT4_MMA_ROWS=0 $PY scripts/gpu_quant.py --device cuda --out "$R/grid_mma0" \
    --preset small --parts grid --grid-targets int4 --grid-drafts none,int4 --grid-quant-kernels triton --repeats 3
elif [ "$PART" = m3 ]; then
  # twentieth session: m2 found no end-to-end change on small (launch-bound). At 6.7 B (random weights, batch 1) the
  # n-gram drafter at k = 4 puts 5-row int4 verifies in the model: tinygemm, ours with verifies on int4_mma (+all:
  # norm and SwiGLU prologues; default fusion "residual": SwiGLU by PyTorch), ours with the old verify (+mma0); then
  # AR rows of bf16 and ours in the same process
  # First the mma part again with PREFETCH (each group's x, scales and zeros loaded an iteration ahead) as a grid
  # dimension, 6.7 B at 1 and 5 rows
  step mma67 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/mma67" --parts mma --sweep-configs 6.7b \
    --mma-ms 1,5 --mma-block-n 64,128 --mma-warps 4,8 --mma-stages 3 --mma-per-sm 2,4 --mma-prefetch 0,1 --replays 10
  C=graphs+compile+overlap
  floor ngram67 60 6.7b --floor-ngram 4 --formats "none@$C,int4@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+mma0@$C,int4-triton+pdl@$C"
  floor ar67 40 6.7b --formats "none@$C,int4@$C,int4-triton+all+pdl@$C"
elif [ "$PART" = m4 ]; then
  # twentieth session: m3 timed 6.7 B n-gram verifies (k = 4, nothing accepted on random weights: every step a 5-row
  # verify) at 3.963 ms with int4_mma's norm / SwiGLU prologues against 3.325 without them (fusion "residual"); now
  # verify-width int4 calls leave the prologues to torch.compile (QuantLinear._fuses_prologue). The same rows again,
  # then AR rows; then (small trained) k13's serving check at 0.5x with 5 rounds, and small's int4 grid
  C=graphs+compile+overlap
  floor ngram67 60 6.7b --floor-ngram 4 --formats "none@$C,int4@$C,int4-triton+all+pdl@$C,int4-triton+pdl@$C"
  floor ar67 40 6.7b --formats "none@$C,int4@$C,int4-triton+all+pdl@$C"
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method draft \
    --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 0.5 --repeats 5 \
    --budget-s "${SERVING_S:-200}"
  step grid 50 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none --grid-quant-kernels aten,triton --repeats 3
elif [ "$PART" = n1 ]; then
  # twenty-first session: one-row int4 in CUDA C++ (kernels/int4_cuda.py; nvcc on the machine). Per linear: parity and
  # a tile grid beside bf16, tinygemm and our Triton GEMV, 6.7 B then 1.45 B; then the 6.7 B AR floor with it
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-rows-per-warp 1,2,4 --cuda-unroll 2,4 --cuda-warps 4,8 --cuda-wps 4 --cuda-pdl 1 --replays 10
  step cuda67s 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67s" --parts cuda --sweep-configs 6.7b \
    --cuda-rows-per-warp 4 --cuda-unroll 4 --cuda-warps 4 --cuda-wps 1,2,4 --cuda-pdl 0,1 --replays 10
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cu@$C,int4-triton+all+pdl+cur2@$C,int4-triton+all+pdl+cuw8@$C,int4-triton+all+pdl+cus1@$C"
  step cuda145 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda145" --parts cuda --sweep-configs 1.45b \
    --cuda-rows-per-warp 1,2,4 --cuda-unroll 2,4 --cuda-warps 4,8 --cuda-wps 4 --cuda-pdl 1 --replays 10
elif [ "$PART" = n2 ]; then
  # twenty-first session: n1 timed the CUDA int4 GEMV 1.28x faster than the Triton one per 6.7 B layer with each
  # shape's best tile (41.1 against 52.6 us), but 3 % slower in the model with one tile for all (2.12 against 2.056
  # ms). Now each shape takes the rule tile (int4_cuda_tile); a finer grid around it (U = 1, 8 rows a warp, 2 words
  # per fp16 sum), each fusion timed, then the floor with the rule under three fusions, profiled
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-rows-per-warp 2,4,8 --cuda-unroll 1,2,4 --cuda-warps 4,8 --cuda-wps 2,4 --cuda-pdl 1 --replays 10
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cu@$C,int4-triton+glo+pdl+cu@$C,int4-triton+res+pdl+cu@$C,int4-triton+all+pdl+cu+cus2@$C"
  floor prof67 40 6.7b --profile --formats "int4-triton+all+pdl+cu@$C"
elif [ "$PART" = n3 ]; then
  # twenty-first session: n2 put 6.7 B int4 decode at 1.883 ms (2.32x bf16) with the rule tiles and all fusions; the
  # norm / SwiGLU prologues cost 1.7-2.7 us per linear. Now the prologue's loads are issued together, and PIPE (the
  # next step's weights in flight during this step's math) is a grid dimension; then the floor with the rule, with
  # PIPE for every shape, and the rule tiles re-picked from this sweep (gemv tiles JSON), profiled once
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-rows-per-warp 2,4,8 --cuda-unroll 1,2,4 --cuda-warps 4,8 --cuda-wps 4 --cuda-pipe 0,1 --replays 10
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cu@$C,int4-triton+all+pdl+cup@$C,int4-triton+all+pdl+cub@$C" \
    --int4-cuda-best "$R/cuda67/gemv_cuda.json"
elif [ "$PART" = n4 ]; then
  # twenty-first session: n3 found the tiles' speed set by occupancy (the same non-PIPE tile 1.26x slower at 138
  # registers than at 128, 3 blocks per SM instead of 4); with each shape's best tile the floor read 1.864 ms (2.33x).
  # Now fusions are compiled in (a plain call holds no prologue registers), the prologue's x is held packed, and MINB
  # (__launch_bounds__'s blocks per SM) is a grid dimension; the floor with the sweep's best tile per shape
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-rows-per-warp 2,4,8 --cuda-unroll 1,2 --cuda-warps 4,8 --cuda-wps 4 --cuda-pipe 0,1 --cuda-minb 1,2 \
    --replays 10
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cub@$C,int4-triton+all+pdl+cu@$C" \
    --int4-cuda-best "$R/cuda67/gemv_cuda.json"
elif [ "$PART" = n5 ]; then
  # twenty-first session: n4's kernel (fusions compiled in, the prologue's x packed) was slower for most tiles (r8 u1
  # w4 took 255 registers instead of 140) and is reverted to n3's; MINB (0 = no __launch_bounds__ minimum: a minimum
  # of 1 is not neutral) stays a grid dimension. The sweep again, each fusion timed with the shape's best tile; the
  # floor with the best tiles ("+cub") and with the rule ("+cu"); 1.45 B's floor with the rule
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-rows-per-warp 2,4,8 --cuda-unroll 1,2 --cuda-warps 4,8 --cuda-wps 4 --cuda-pipe 0,1 --cuda-minb 0,2,4 \
    --replays 10
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cub@$C,int4-triton+all+pdl+cu@$C" \
    --int4-cuda-best "$R/cuda67/gemv_cuda.json"
  floor ar145 40 1.45b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cu@$C"
elif [ "$PART" = n6 ]; then
  # twenty-first session: n5 confirmed n3's best tiles (layer 40.2 us against 52.9 for the Triton GEMV) but lost its
  # floor rows to a NameError (the fusion flags' constants dropped in an edit; a CPU test of the launch now covers it).
  # One-row int4 calls now go to the CUDA kernel by default (rule tiles). Parity through the modules (1 row: CUDA, 2-5:
  # int4_mma), each fusion timed at the rule's tiles, then the floors against the Triton GEMV ("+cu0"), profiled;
  # PERSIST beside each (as many blocks per SM as fit, each looping over row groups with x staged once: "+cug", "g8")
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl+cu0@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cug@$C,int4@$C"
  step parity 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/parity" --parts parity --configs 6.7b,1.45b \
    --formats int4 --ms 1,2,5
  step cuda67 30 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-tiles "r8 u1 w4 s4;r2 u2 w8 s4 pipe;r4 u2 w4 s4 pipe;r8 u1 w4 s4 g8;r2 u2 w8 s4 pipe g8;r4 u2 w4 s4 pipe g8;r4 u2 w4 s4 pipe g2" \
    --replays 10
  floor ar145 40 1.45b --formats "none@$C,int4-triton+all+pdl+cu0@$C,int4-triton+all+pdl@$C"
  floor prof67 30 6.7b --profile --formats "int4-triton+all+pdl@$C"
elif [ "$PART" = n7 ]; then
  # prepared in the twenty-first session (no device time left): n6 put 6.7 B int4 at 2.351x bf16 with the CUDA GEMV,
  # whose tiles were picked on plain calls while the model fuses the RMSNorm into q/k/v and gate/up and SwiGLU +
  # residual into down; the prologues cost 0.8-3.2 us a call, set by how many blocks restage x. The sweep with each
  # linear's model fusion, then the floor with those tiles ("+cub") against the rule
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-model-fusion --cuda-rows-per-warp 2,4,8 --cuda-unroll 1,2 --cuda-warps 4,8 --cuda-wps 4 --cuda-pipe 0,1 \
    --cuda-minb 0 --replays 10
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl+cu0@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cub@$C" \
    --int4-cuda-best "$R/cuda67/gemv_cuda.json"
elif [ "$PART" = n9 ]; then
  # twenty-second session: n7's sweep with each linear's model fusion, then the 6.7 B floor with its tiles ("+cub")
  # and with the LM head quantized too ("+qh", the new knob quant_head: gpt-fast's int4 does it; the bf16 head was
  # 0.065 ms of an int4 token in k10's profile); the same at 1.45 B; a profile of the fastest form
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-model-fusion --cuda-rows-per-warp 2,4,8 --cuda-unroll 1,2 --cuda-warps 4,8 --cuda-wps 4 --cuda-pipe 0,1 \
    --cuda-minb 0 --replays 10
  C=graphs+compile+overlap
  B="$R/cuda67/gemv_cuda.json"
  floor ar67 60 6.7b --int4-cuda-best "$B" --formats "none@$C,int4-triton+all+pdl+cu0@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+cub@$C,int4-triton+all+pdl+qh@$C,int4-triton+all+pdl+cub+qh@$C"
  floor ar145 40 1.45b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+qh@$C"
  floor prof67 30 6.7b --profile --int4-cuda-best "$B" --formats "int4-triton+all+pdl+cub+qh@$C"
elif [ "$PART" = n10 ]; then
  # twenty-second session: n9 put 6.7 B int4 with the quantized head at 2.411x bf16 (1.824 ms; 2.5x is 1.759) and its
  # profile at 3.1 us a layer for the K/V write (one program copies all 32 heads at decode) and ~6 us a layer for the
  # GEMVs' fused prologues over the plain calls. PIPE 2 (both steps of the pipeline loaded before x is staged) on
  # the fused calls, against the rule's tiles; then the floor with its best tiles and the K/V write split over heads
  step cuda67 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/cuda67" --parts cuda --sweep-configs 6.7b \
    --cuda-model-fusion --replays 10 --cuda-tiles "r8 u1 w4 s4;r4 u2 w4 s4 pipe;r2 u2 w8 s4 pipe;r2 u1 w4 s4 pipe2;r2 u1 w8 s4 pipe2;r2 u2 w4 s4 pipe2;r2 u2 w8 s4 pipe2;r2 u2 w8 s4 pipe2 b2;r4 u1 w4 s4 pipe2;r4 u1 w8 s4 pipe2;r4 u1 w8 s4 pipe2 b2;r4 u2 w4 s4 pipe2;r4 u2 w8 s4 pipe2;r8 u1 w4 s4 pipe2;r2 u2 w4 s4 pipe2 b4;r8 u1 w4 s4 pipe"
  C=graphs+compile+overlap
  B="$R/cuda67/gemv_cuda.json"
  I=int4-triton+all+pdl+qh
  floor ar67 60 6.7b --int4-cuda-best "$B" --formats "none@$C,none+kvh4@$C,none+kvh1@$C,$I@$C,$I+kvh4@$C,$I+kvh1@$C,$I+cub@$C,$I+cub+kvh4@$C,$I+cub+kvh1@$C,int4-triton+all+pdl+cub+kvh1@$C"
  floor ar145 40 1.45b --formats "none@$C,none+kvh1@$C,$I@$C,$I+kvh1@$C"
elif [ "$PART" = n11 ]; then
  # twenty-second session: the quantized LM head's quality cost on a trained model (the floor's random weights show
  # its speed only): small's grid with the draft model (k = 4), int4 target and draft, head float and quantized,
  # the default kernel (ours, CUDA GEMV for one-row int4 calls), also n8's question (the CUDA GEMV on small)
  train_small
  step grid 100 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none,int4 --grid-quant-kernels triton --grid-quant-head 0,1 --repeats 3
  step grid_cu0 60 env WORKBENCH_INT4_CUDA=0 $PY scripts/gpu_quant.py --device cuda --out "$R/grid_cu0" \
    --preset small --parts grid --grid-targets int4 --grid-drafts none,int4 --grid-quant-kernels triton --repeats 3
elif [ "$PART" = n12 ]; then
  # twenty-second session, last call (about 170 s of device time left): SwiGLU in gate/up's epilogue ("+ge",
  # linears.INT4_GLU_EPILOGUE, int4_gemv.cu F_GLU_OUT), so down has no SwiGLU prologue (2.1 us a layer in n10); the
  # kernel's edit also moved registers (r4u2w4 pipe 151 -> 155, r2u2w8 pipe 115 -> 99, r8u1w4 140 -> 144), so the
  # default row is timed again beside it
  C=graphs+compile+overlap
  I=int4-triton+all+pdl+qh
  floor ar67 40 6.7b --formats "none@$C,$I@$C,$I+ge@$C"
elif [ "$PART" = n13 ]; then
  # twenty-second session, the last call: the SwiGLU epilogue now the default ("+ge0" is the old route), with the
  # tokens of each row compared with the row before the switch; 6.7 B and 1.45 B
  C=graphs+compile+overlap
  I=int4-triton+all+pdl+qh
  floor ar67 40 6.7b --formats "none@$C,$I+ge0@$C,$I+ge@$C"
  floor ar145 25 1.45b --formats "none@$C,$I+ge0@$C,$I+ge@$C"
elif [ "$PART" = n14 ]; then
  # twenty-third session: attention writes the step's K / V itself ("+fkv", paged_attention.FUSE_KV_WRITE: one launch
  # a layer instead of the K/V write and attention; n9's profile put the write at 2-3 us a layer), fewer attention
  # splits where the table is short ("+stN": 3 splits of one 64-key tile each at 192 positions, then the combine),
  # and n13's question: the SwiGLU epilogue's tokens against the old route's ("+ge0" first). Then n-gram verifies
  # (T = 4) through the fused write, and a profile. Both lost and were removed after the call (commit 4382125 has them)
  C=graphs+compile+overlap
  I=int4-triton+all+pdl+qh
  floor ar67 60 6.7b --formats "none@$C,none+fkv@$C,none+st4@$C,$I+ge0@$C,$I@$C,$I+fkv@$C,$I+st2@$C,$I+st4@$C,$I+fkv+st4@$C"
  floor ar145 30 1.45b --formats "none@$C,none+fkv@$C,$I+ge0@$C,$I@$C,$I+fkv@$C"
  floor ng67 40 6.7b --floor-ngram 3 --formats "none@$C,none+fkv@$C,$I@$C,$I+fkv@$C"
  floor prof67 30 6.7b --profile --formats "$I+fkv@$C"
elif [ "$PART" = n15 ]; then
  # twenty-third session: n14's +fkv and +stN lost. The norm prologues read the RMSNorm weight in every block (gate/up
  # 19.81 against 16.78 us plain in n10); int4 now quantizes with that weight folded into q/k/v and gate/up
  # (quant.FOLD_NORMS), and the CUDA GEMV skips the read (F_NORM_UNIT). "+fn0" is the old route; each pair twice
  C=graphs+compile+overlap
  I=int4-triton+all+pdl+qh
  floor ar67 60 6.7b --formats "none@$C,$I+fn0@$C,$I@$C,$I+fn0@$C,$I+fn@$C"
  floor ar145 30 1.45b --formats "none@$C,$I+fn0@$C,$I@$C"
  floor prof67 30 6.7b --profile --formats "$I@$C"
elif [ "$PART" = n16 ]; then
  # twenty-third session: n15 put int4 + quantized head with the norms folded at 2.56x bf16; the float-head int4 (the
  # quant_head default) beside it, then the fold's quality on the trained small preset (grid, draft model k = 4, int4
  # target and draft), folded (the default) and as loaded (WORKBENCH_INT4_FOLD_NORMS=0), in two processes
  C=graphs+compile+overlap
  floor ar67 60 6.7b --formats "none@$C,int4-triton+all+pdl+fn0@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+qh@$C"
  train_small
  step grid 80 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none,int4 --grid-quant-kernels triton --repeats 3
  step grid_fn0 50 env WORKBENCH_INT4_FOLD_NORMS=0 $PY scripts/gpu_quant.py --device cuda --out "$R/grid_fn0" \
    --preset small --parts grid --grid-targets int4 --grid-drafts none,int4 --grid-quant-kernels triton --repeats 3
elif [ "$PART" = n17 ]; then
  # twenty-third session, last call: n16's float-head int4 read 2.499x in one row; bf16 and int4 twice each, in turn,
  # in one process, 6.7 B, then 1.45 B once
  C=graphs+compile+overlap
  I=int4-triton+all+pdl
  floor ar67 60 6.7b --formats "none@$C,$I@$C,none@$C,$I@$C,$I+qh@$C"
  floor ar145 30 1.45b --formats "none@$C,$I@$C,$I+qh@$C"
elif [ "$PART" = n8 ]; then
  # prepared in the twenty-first session: the CUDA GEMV serves one-row int4 calls on small too (50 MB, launch-bound),
  # untimed there. Small's int4 grid with the draft model (k = 4): tinygemm, ours with it (the default) and ours
  # without it (WORKBENCH_INT4_CUDA=0), in two processes
  train_small
  step grid 100 $PY scripts/gpu_quant.py --device cuda --out "$R/grid" --preset small --parts grid \
    --grid-targets none,int4 --grid-drafts none,int4 --grid-quant-kernels aten,triton --repeats 3
  step grid_cu0 60 env WORKBENCH_INT4_CUDA=0 $PY scripts/gpu_quant.py --device cuda --out "$R/grid_cu0" \
    --preset small --parts grid --grid-targets int4 --grid-drafts none,int4 --grid-quant-kernels triton --repeats 3
elif [ "$PART" = k13 ]; then
  # twentieth session: k12's draft-model goal check missed at 0.5x by goodput (0.528 of the best) while goodput swung
  # 20x between its 3 rounds, and read 0.976 (within noise) at 1.0x. The same check at those two rates with 5 rounds,
  # to tell a miss from noise (no code in the serving path changed since k12)
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method draft \
    --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 0.5,1.0 --repeats 5 \
    --budget-s "${SERVING_S:-300}"
elif [ "$PART" = k14 ]; then
  # twenty-third session: k13's 5-round check at 1.5x, the rate k13 left out, where the replay overpredicted the
  # held-out k = 2 in four earlier calls (+5.7 to +15.3 %, new model) and the per-step fit read -10.9 % in k12 (no code
  # in the serving path changed since k12)
  step serving 100 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method draft \
    --k 4 --max-num-seqs 64 --num-requests 512 --warmup-requests 64 --rates 1.5 --repeats 5 \
    --budget-s "${SERVING_S:-240}"
elif [ "$PART" = q4 ]; then
  # prepared in the nineteenth session (no device time left): int4 prefill with no bf16 weight written at all, through
  # the GEMV kernel's tensor-core form in 16-row tiles (linears.INT4_PREFILL_GEMM_ROWS; q2's one-kernel dequant still
  # left the 6.7 B prefill at 3.2x bf16's for a 64-token prompt). Per linear at 17-512 rows, then the floor's prefill
  C=graphs+compile+overlap
  step prefill 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/prefill" --parts prefill --sweep-configs 6.7b \
    --prefill-ms 17,32,64,128,512 --replays 10
  floor quant67 60 6.7b --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+pg@$C"
  floor quant67_p512 60 6.7b --prompt-len 512 --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+pg@$C"
elif [ "$PART" = q3 ]; then
  # nineteenth session: q2's read floor put the 6.7 B int4 layer's GEMVs at 52.6 us against 31.5 us for one launch
  # that only streams the same bytes, whose best tiles run 800-2,900 small programs where our GEMV runs 256-688
  # large ones. Split-K was never swept for int4 (the tune took 1 and gemv_config's split only): BLOCK_N x BLOCK_K x
  # SPLIT_K 1, 2, 4, 8 at 4 warps, packed fp16 words; then the floor with the best tiles (+tc) and +all
  C=graphs+compile+overlap
  step tune 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune" --parts tune --sweep-configs 6.7b \
    --formats int4 --tune-block-n 8,16,32 --tune-block-k 512,1024 --tune-warps 4 --tune-stages 3 --tune-half2 1 \
    --tune-splits 1,2,4,8 --replays 20 --tune-budget-s "${TUNE_S:-100}"
  T=$R/tune/gemv_tune_tiles.json; mkdir -p "$R/tune"; [ -f "$T" ] || echo '{}' > "$T"
  floor quant67 50 6.7b --m1-tiles "$T" --formats "none@$C,int4-triton+all+pdl@$C,int4-triton+all+pdl+tc@$C"
elif [ "$PART" = q2 ]; then
  # prepared in the eighteenth session (no device time left): int4's prefill. k10's profile of the 6.7 B int4 model
  # (kernel "triton") put ~71 ms of GPU time per 64-token prompt in the six PyTorch ops that dequantize each weight
  # past GEMV_MAX_ROWS. Per linear at 6.7 B, 64 and 512 rows: bf16, tinygemm, the PyTorch ops, the one-kernel dequant
  # (kernels/int4_dequant.py); then the floor at 6.7 B with each row's prefill time, 64- and 512-token prompts
  C=graphs+compile+overlap
  step prefill 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/prefill" --parts prefill --sweep-configs 6.7b \
    --prefill-ms 64,512 --replays 10
  # + the norm prologue row (+all): k10's profile put 0.137 ms per token in the two norm kernels at 6.7 B (e4 timed
  # +all equal to +glo, 3.080 vs 3.082 ms, when the GEMVs took 1.4x longer than now)
  floor quant67 60 6.7b --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+dq@$C,int4-triton+all+pdl@$C,int4@$C"
  # the read floor (nineteenth session): each 6.7 B linear's int4 and bf16 bytes streamed by one launch of
  # kernels/stream_read.py (a tile grid, best marked) beside our GEMV, tinygemm and F.linear, and the layer's sums
  step read 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/read" --parts read --sweep-configs 6.7b --replays 20
  floor quant67_p512 60 6.7b --prompt-len 512 --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+dq@$C,int4@$C"
elif [ "$PART" = q1 ]; then
  # run in the eighteenth session (both variants lost and were removed after it, BENCHMARKS.md 23.1: rerunning it needs
  # commit dd84419): prepared in the seventeenth session: two one-row int4 loop variants built
  # after issue 10's 1.96x, checked bit for bit under the interpreter. REG_PREFETCH: the next tile's words a tile ahead
  # in registers. X_LANES: x loaded lane by lane in the words' layout; the SASS compiled on the CPU VM has no barrier in
  # the K loop where a thread holds at most 8 words (16 x 1024 or 32 x 512 with 8 warps, 16 x 512 with 4), against
  # 8-14 per iteration in the default form (BENCHMARKS.md 22.5). Per linear at 6.7 B under each switch (one process
  # each), a tile sweep with both as dimensions, then the floor with each switch and with the sweep's tiles (+tc)
  C=graphs+compile+overlap
  for v in "0 0" "1 0" "0 1" "1 1"; do
    read -r rp xl <<< "$v"
    step "lin_rp${rp}_xl${xl}" 15 env WORKBENCH_INT4_REG_PREFETCH="$rp" WORKBENCH_INT4_X_LANES="$xl" $PY \
      scripts/gpu_gemv.py --device cuda --out "$R/lin_rp${rp}_xl${xl}" --parts speed --configs 6.7b --formats int4 \
      --ms 1 --replays 20
  done
  step tune 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/tune" --parts tune --sweep-configs 6.7b \
    --formats int4 --tune-block-n 8,16,32 --tune-block-k 512,1024 --tune-warps 4,8 --tune-stages 3 --tune-half2 1 \
    --tune-x-lanes 0,1 --tune-reg-prefetch 0,1 --replays 20 --tune-budget-s "${TUNE_S:-150}"
  T=$R/tune/gemv_tune_tiles.json; mkdir -p "$R/tune"; [ -f "$T" ] || echo '{}' > "$T"
  floor quant67 60 6.7b --m1-tiles "$T" --formats "none@$C,int4-triton+glo+pdl@$C,int4-triton+glo+pdl+rp@$C,\
int4-triton+glo+pdl+xl@$C,int4-triton+glo+pdl+rp+xl@$C,int4-triton+glo+pdl+tc@$C"
elif [ "$PART" = z7 ]; then
  # prepared in the fifteenth session, not run: batched prefill (serving.loop.BATCH_PREFILL: an iteration's prefill
  # chunks in forwards of up to 4 rows, CPU-tested) against a forward per row, off and fixed k, on small at 1.0x and
  # 1.5x in 3 rotated rounds (z5's replay fit charged 1.41 ms per prefill forward; prefill took 1.2-1.4 s of each 3 s
  # run)
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 768 --warmup-requests 64 --rates 1.0,1.5 --repeats 3 --no-thresholds \
    --k-by-batch 1-64:3 --batch-prefill-controls 4 --budget-s "${SERVING_S:-300}"
elif [ "$PART" = e2 ]; then
  # eleventh session: sp1's benches in bf16 (cuBLAS against the dense Triton GEMV in the 5-token verify, with and
  # without the norm prologues), then the speed part again with the prefill's GPU time per call
  train_small
  for kern in "auto residual" "triton residual" "triton norm+glu+residual"; do
    set -- $kern
    ngram_small "bench_ngram_$1_${2//+/-}" "$1" "$2"
  done
  step speed 60 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small \
    --modes graphs+compile+overlap --methods ar,ngram:4,ngram:2 --repeats 5
elif [ "$PART" = sp1 ]; then
  # prepared for the next session, not run yet: issue 8's speculative overhead on small (batch 1, n-gram k = 4) with
  # the decoder linears on cuBLAS (quant_kernel auto) against the dense Triton GEMV (its M > 1 tiles in the 5-token
  # verify) with and without the norm prologues; bench reports speedup_vs_ar and the accepted tokens per step
  train_small
  for kern in "auto residual" "triton residual" "triton norm+glu+residual"; do
    set -- $kern
    ngram_small "bench_ngram_$1_${2//+/-}" "$1" "$2"
  done
elif [ "$PART" = n ]; then
  # fifth session, second call (no preset): int8 / fp8 widened by integer ops (CVT_BITS) against conversion
  # instructions per linear, fp16 tensor-core verify tiles, the floor with the norm prologue's fix, GGUF Q8_0 (int8g)
  step cvt 40 $PY scripts/gpu_gemv.py --device cuda --out "$R/cvt" --parts cvt,f16 --formats fp8,int8 \
    --configs 6.7b,1.45b --ms 1,4,9 --replays 10
  C=graphs+compile+overlap; A=graphs+max-autotune+overlap
  F="none@$C,none@$A,dense-triton+glu@$C,dense-triton+all@$C,fp8-triton+glu@$C,fp8-triton+all@$C"
  floor quant67 120 6.7b \
    --formats "$F,int8-triton+glu@$C"
  floor quant145 60 1.45b \
    --formats "$F"
  step gguf 40 $PY scripts/gpu_gguf.py --device cuda --out "$R/gguf"
elif [ "$PART" = o ]; then
  # fifth session, third call: GGUF Q8_0 / Q4_1 kept packed (int8g with K tiles spanning groups; the file's
  # metadata needs gguf's dist-info in .whl/pylib), then `small` for study throughput (the timed passes split, the
  # non-blocking block-table upload, reused CUDA events, 17 kept engines) and serving with the replay's draft costs
  step gguf 40 $PY scripts/gpu_gguf.py --device cuda --out "$R/gguf" --max-new-tokens 64 --repeats 3
  train_small
  step study 100 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-140}" \
    --out "$R/study"
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" \
    --budget-s "${SERVING_S:-110}"
elif [ "$PART" = p ]; then
  # fifth session, last call: the 6.7 B floor with this session's defaults (fp8 without integer-op widening; norm
  # prologue vs not), then `small` for serving after the calibration fix (issue 11: the replay's draft costs)
  C=graphs+compile+overlap
  floor quant67 100 6.7b \
    --formats "none@$C,dense-triton+glu@$C,fp8-triton+glu@$C,fp8-triton+all@$C"
  train_small
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" \
    --budget-s "${SERVING_S:-110}"
elif [ "$PART" = q ]; then
  # sixth session, first call: the captured prefill (target and draft model; prefill_graphs): greedy parity of
  # graphs vs the eager step on the GPU (tiny), then study throughput on `small` with the prefill captured and, in
  # the same call right after, without it (the old eager prefill)
  step parity 60 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
  train_small
  step study_on 100 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-130}" \
    --out "$R/study_on"
  step study_off 100 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-130}" \
    --prefill-graphs off --out "$R/study_off"
elif [ "$PART" = r ]; then
  # sixth session, second call: serving with the replay scored against the rounds' medians (issue 11), then the
  # study-throughput pair of call q in the other order (eager prefill first), so that drift cannot favour one side
  train_small
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" \
    --budget-s "${SERVING_S:-110}"
  step study_off 90 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-110}" \
    --prefill-graphs off --out "$R/study_off"
  step study_on 90 $PY scripts/study_throughput.py --device cuda --preset small --seconds "${STUDY_S:-110}" \
    --out "$R/study_on"
elif [ "$PART" = s ]; then
  # sixth session, last call: serving with 4x longer measured windows (128 requests per run instead of 32), to see
  # whether call r's misses at 2.0x saturation (runs of 0.5-1 s) were the windows' noise
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --num-requests 128 \
    --warmup-requests 16 --no-thresholds --budget-s "${SERVING_S:-300}"
elif [ "$PART" = t ]; then
  # seventh session: serving's prefill chunks captured (prefill_graphs, the default) against eager prefill in the
  # same rounds and arrivals (--eager-prefill-controls), with call s's 128-request windows
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --num-requests 128 \
    --warmup-requests 16 --no-thresholds --eager-prefill-controls --budget-s "${SERVING_S:-320}"
elif [ "$PART" = u ]; then
  # eighth session, first call: the n-gram lookup on the device (captured, overlapped): the speculative overhead on
  # small (step modes, one process), the batch sweep on small with overlapped graphs, greedy parity on tiny
  train_small
  step speed 90 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small \
    --modes graphs+compile,graphs+compile+overlap
  step sweep 90 $PY scripts/gpu_fastpath.py --out "$R/sweep" --parts sweep --preset small --sweep-mode graphs+overlap \
    --batches 1,2,4,8,16,32,64 --repeats 3
  step parity 60 $PY scripts/gpu_fastpath.py --out "$R/parity" --parts parity --preset tiny
elif [ "$PART" = v ]; then
  # eighth session, second call (right after u, small still on disk): serving with the prefill chunks captured,
  # against eager prefill and against an unfrozen GC heap in the same rounds and arrivals
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --num-requests 128 \
    --warmup-requests 16 --no-thresholds --eager-prefill-controls --gc-controls --budget-s "${SERVING_S:-440}"
elif [ "$PART" = w ]; then
  # eighth session, third call: the speculative overhead of device n-gram steps by draft length (one process), then
  # serving with the n-gram drafter (its loop calibration may give a schedule with thresholds: the +/- 1 cliff check)
  train_small
  step speed 90 $PY scripts/gpu_fastpath.py --out "$R/speed" --parts speed --preset small \
    --modes graphs+compile+overlap --methods ar,ngram:1,ngram:2,ngram:3,ngram:4,ngram:6
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --num-requests 128 --warmup-requests 16 --budget-s "${SERVING_S:-300}"
elif [ "$PART" = x ]; then
  # eighth session, last call: n-gram serving up to 64 live sequences, where its calibration can find the batch size
  # at which drafting stops paying (the sweep of call u: 1.15x at 32, 0.89x at 64): a schedule with a threshold
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 256 --warmup-requests 64 --rates 0.5,1.0,1.5 --budget-s "${SERVING_S:-240}"
elif [ "$PART" = z ]; then
  # prepared for the next session, not run yet: call x again with the monotone schedule and, in the same rounds and
  # at the thresholds of both schedules, the free one (--shape-controls): does the shape remove call x's cliffs?
  train_small
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset small --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 256 --warmup-requests 64 --rates 0.5,1.0,1.5 --shape-controls \
    --budget-s "${SERVING_S:-330}"
elif [ "$PART" = zs ]; then
  # prepared for the next session, not run yet: call y again (tiny, committed: no training) with the sticky shape
  # (the default since the ninth session) and, in the same rounds and at both schedules' thresholds, the monotone
  # one (--shape-controls): does sticky remove call y's cliff at 33?
  step serving 120 $PY scripts/gpu_serving.py --device cuda --preset tiny --out "$R/serving" --method ngram --k 4 \
    --max-num-seqs 64 --num-requests 256 --warmup-requests 64 --rates 1.0 --repeats 3 --shape-controls \
    --budget-s "${SERVING_S:-200}"
elif [ "$PART" = c ]; then
  heads
  # issue 10: Triton weight-only GEMVs (parity, speed vs aten and bf16, decode of the random 6.7 B)
  step gemv 60 $PY scripts/gpu_gemv.py --device cuda --out "$R/gemv"
  # the de-duplicated step loop (generate through decode_step) against the pre-merge step.py, same process; the
  # device copy has no git history, so make the reference here first (untracked, it travels; delete it afterwards):
  #   git show 9d7cddc:workbench/engine/step.py > scripts/_ref_step.py
  if [ -s scripts/_ref_step.py ]; then
    step step_loop 40 $PY scripts/bench_step_loop.py --device cuda --out "$R/step_loop" --preset small \
      --ref-step scripts/_ref_step.py
  else
    echo "[skip] step_loop: no scripts/_ref_step.py" | tee -a "$R/steps.txt"
  fi
  # issue 9: trees again, now that overlapped steps time their phases (the draft model's cost ratio)
  step trees 60 $PY scripts/bench_trees.py --preset small --device cuda --out "$R/trees" --budget-s "${TREES_S:-120}"
  # issue 8: study throughput in bf16 (the first run used the study default, float32), for longer
  step study 60 timeout "${STUDY_S:-150}" $PY -m studies.run --preset small --study thr16 --trials 1000 \
    --device cuda --cuda-graphs on --dtype bfloat16 --num-prompts 8 --max-new-tokens 128 \
    --storage sqlite:////tmp/thr16.db --store /tmp/thr16
  $PY scripts/store_counts.py /tmp/thr16 > "$R/study_count.txt" 2>&1
  # issue 11: the serving study (replay first, the best few for real)
  step serving_study 60 $PY -m studies.serving --preset small --device cuda --dtype bfloat16 --study serve-h200 \
    --storage sqlite:////tmp/serve.db --no-store --method draft --k 4 --rate 8 --num-requests 32 --warmup-requests 4 \
    --max-new-tokens 64 --max-num-seqs 16 --replay-trials 60 --real-trials 4 --out "$R/serving_study"
else
  heads
  # issue 8: study throughput, one worker, 8 prompts x 128 new tokens, graphs on
  step study 60 timeout "${STUDY_S:-90}" $PY -m studies.run --preset small --study thr --trials 1000 \
    --device cuda --cuda-graphs on --num-prompts 8 --max-new-tokens 128 --storage sqlite:////tmp/thr.db --store /tmp/thr
  $PY scripts/store_counts.py /tmp/thr > "$R/study_count.txt" 2>&1
  # issue 10: weight formats (random-weight floors, then the small preset's precision grid) and KV formats
  step quant 60 $PY scripts/gpu_quant.py --device cuda --out "$R/quant" --preset small ${QUANT_ARGS:-}
  step kvquant 40 $PY scripts/gpu_kvquant.py --device cuda --out "$R/kvquant" ${KVQUANT_ARGS:-}
  # issue 11: serving rate sweep
  step serving 60 $PY scripts/gpu_serving.py --device cuda --preset small --cuda-graphs --out "$R/serving" \
    ${SERVING_ARGS:-}
fi
tar -czf "$OUT/$PART.tgz" -C "$OUT" "$PART"
echo "total $(( $(date +%s) - t0 )) s"
