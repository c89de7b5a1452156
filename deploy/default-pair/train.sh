#!/usr/bin/env bash
# Rebuilds the embedded default pair (services/sanctum/assets/default/README.md says what it is):
#   train.sh target     the long-context target, packed to 6 bits, then its regenerated data
#   train.sh drafters   the DFlash 2 and DFlash drafters against the packed target, packed to 8 bits
#   train.sh install    the packed pair into services/sanctum/assets/default
#   train.sh finetune   the second generation's first fine-tune: the first-generation drafter at
#                       $INIT re-layered to slide over $FT_WINDOW rows, fine-tuned at $SEQ tokens
#                       as DFlash 2 and as DFlash (one after the other: together they need more
#                       memory than one GPU) against the shipped target, on $W/regen.npz (made on
#                       the CPU if absent)
#   train.sh gpu-regen  the shipped drafter, step 1: $GPU_PARTS x 256 regenerated sequences of
#                       $SEQ tokens, 8 spans of 128 tokens each, made on the GPU (seeds 100, 101, ...)
#   train.sh refine     step 2: the shipped drafter fine-tuned on them twice (lr 3e-4 for $REFINE1_S s,
#                       then lr 2.5e-4 for $REFINE2_S s from the first), packed, then its sampling
#                       temperature scale fitted on the held-out regenerated rows (`train calibrate`)
#   train.sh short-regen  $SHORT_COUNT short sequences: a prompt ending by token 96 (two in three a
#                       training function's stub, raw or as a chat turn), then 160 tokens of the
#                       shipped target's reply, where `bench tau`'s context-0 prompts sit
#   train.sh review-regen  $REVIEW_PARTS x 256 review chats of $SEQ tokens (`train regen --review`:
#                       bench multiturn's conversation, each of 8 spans of 128 tokens the target's
#                       reply to a "Review this code" turn), merged with $W/regen-gpu.npz into
#                       $W/regen-chat.npz (run gpu-regen first)
#   train.sh mixed      the shipped drafter refined at $SEQ tokens on $REGEN (default
#                       $W/regen-gpu.npz: gpu-regen with SEED0=200, sequences it has not seen)
#                       with every 4th step on $W/short.npz, labels $MIXED_DISTILL x the target's
#                       distribution, for $MIXED_S s; packed to $MIXED_OUT-packed and calibrated
#                       (REGEN=$W/regen-chat.npz: the review-chat run, not shipped; assets README)
# Run from the repository root, with `sanctum` importable (PYTHONPATH=services or the venv) and a
# corpus from `sanctum train corpus` at $CORPUS. The defaults are the shipped run's (one large GPU,
# MLX with its CUDA backend); the variables below scale it down for a smoke run on a CPU.
set -euo pipefail
W=${W:-runs/pair}                      # work folder
CORPUS=${CORPUS:-runs/data/stdlib.npz}
SEQ=${SEQ:-4096}                       # training window, tokens
TARGET_S=${TARGET_S:-220}              # wall-clock budgets (s): each schedule is fitted to its budget
DRAFTER_S=${DRAFTER_S:-200}            # both drafters train at once (the GPU has room for two)
STEPS=${STEPS:-20000}                  # upper bound on steps (the budgets decide)
TARGET_BATCH=${TARGET_BATCH:-32}
BATCH=${BATCH:-16}
REGEN_COUNT=${REGEN_COUNT:-512}
REGEN_BATCH=${REGEN_BATCH:-16}         # MLX CUDA failed a launch ("invalid argument") at 128
REGEN_HOLDOUT=${REGEN_HOLDOUT:-64}
SPANS=${SPANS:-4}
SPAN_TOKENS=${SPAN_TOKENS:-128}
WINDOW=${WINDOW:-2048}                 # the drafters' sliding window
INIT=${INIT:-runs/drafter-gen1}         # finetune: the first-generation drafter (assets README)
FT_WINDOW=${FT_WINDOW:-256}
FT_S=${FT_S:-300}
GPU_PARTS=${GPU_PARTS:-6}
REFINE1_S=${REFINE1_S:-215}
REFINE2_S=${REFINE2_S:-440}
SEED0=${SEED0:-100}                    # gpu-regen: the parts' seeds are SEED0, SEED0 + 1, ...
SHORT_COUNT=${SHORT_COUNT:-1536}
REVIEW_PARTS=${REVIEW_PARTS:-2}
PART_COUNT=${PART_COUNT:-256}          # gpu-regen, review-regen: sequences a part
PART_HOLDOUT=${PART_HOLDOUT:-32}       # held-out sequences of the first part
REGEN=${REGEN:-$W/regen-gpu.npz}       # mixed: the regenerated 4K rows it refines on
MIXED_S=${MIXED_S:-420}
MIXED_LR=${MIXED_LR:-2e-4}
MIXED_DISTILL=${MIXED_DISTILL:-0.5}
MIXED_OUT=${MIXED_OUT:-$W/mixed}
PY=${PY:-python3 -m sanctum.cli}
TOK=services/sanctum/assets/default/target   # the shipped tokenizer (8,192 byte-level BPE)
mkdir -p "$W"

run() { echo "+ $*" >&2; "$@"; }

target() {
  run $PY train target --tokenizer "$TOK" --data "$CORPUS" --out "$W/target" \
    --hidden 384 --layers 8 --intermediate 1024 --heads 6 --kv-heads 2 --head-dim 64 \
    --gdn-key-heads 4 --gdn-value-heads 8 --gdn-head-dim 64 \
    --steps "$STEPS" --time-budget "$TARGET_S" --batch "$TARGET_BATCH" --seq-len "$SEQ" --lr 2e-3 \
    --warmup 40 --eval-every 50 --log-every 10 --dtype float32
  run $PY train pack --target "$W/target" --out "$W/packed" --target-bits 6
  # the target's own continuations, as it is served (6-bit, dequantized): greedy and sampled
  regen || (export MLX_USE_CUDA_GRAPHS=0; regen)
}

regen() {
  run $PY train regen --target "$W/packed/target" --data "$CORPUS" --out "$W/regen.npz" \
    --count "$REGEN_COUNT" --holdout "$REGEN_HOLDOUT" --seq-len "$SEQ" --spans "$SPANS" \
    --new-tokens "$SPAN_TOKENS" --temperatures 0,0,0.7,1 --batch "$REGEN_BATCH"
}

drafter() {  # drafter KIND OUT BUDGET
  run $PY train drafter --target "$W/packed/target" --data "$CORPUS" --regen-data "$W/regen.npz" \
    --out "$2" --kind "$1" --sliding-window "$WINDOW" --is-causal false --layers 3 \
    --intermediate 1024 --head-dim 64 --kv-heads 2 --taps 1,3,5,7 --block-size 8 \
    --block-sizes 8,16 --seq-len "$SEQ" --batch "$BATCH" --rows-per-seq 1024 --regen-frac 0.5 \
    --steps "$STEPS" --time-budget "$3" --lr 1e-3 --warmup 40 --eval-every 100 --log-every 10 \
    --distill 0.5 --hard-labels target --select tau --dtype float32 --target-dtype float32
}

drafters() {
  drafter dflash2 "$W/drafter2" "$DRAFTER_S" > "$W/drafter2.log" 2>&1 &
  local v2=$!
  drafter dflash "$W/drafter1" "$DRAFTER_S" > "$W/drafter1.log" 2>&1 &  # the comparison
  local v1=$!
  wait $v2 && wait $v1 || { tail -20 "$W"/drafter*.log; return 1; }
  grep -hv '"step"' "$W/drafter2.log" "$W/drafter1.log"
  run $PY train pack --target "$W/packed/target" --drafter "$W/drafter2" --out "$W/packed" \
    --drafter-only --drafter-bits 8
  mkdir -p "$W/packed-v1"
  run $PY train pack --target "$W/packed/target" --drafter "$W/drafter1" --out "$W/packed-v1" \
    --drafter-only --drafter-bits 8
}

install() {  # the DFlash (v1) drafter is not installed: it measured better only at temperature 1
  local A=services/sanctum/assets/default
  if [ -d "$MIXED_OUT-packed/drafter" ]; then  # after mixed: the drafter's weights, config, log
    [ -e "$A/drafter/refine2_train_log.json" ] ||  # the log of the drafter it refined, kept once
      mv "$A/drafter/train_log.json" "$A/drafter/refine2_train_log.json"
    cp "$MIXED_OUT-packed/drafter"/{model.safetensors,config.json,train_log.json} "$A/drafter/"
    return
  fi
  if [ -d "$W/packed-dflash2/drafter" ]; then  # after finetune: the drafter alone
    rm -rf "$A/drafter" && cp -r "$W/packed-dflash2/drafter" "$A/drafter"
    return
  fi
  rm -rf "$A/target" "$A/drafter"
  cp -r "$W/packed/target" "$A/target" && cp -r "$W/packed/drafter" "$A/drafter"
}

finetune() {
  local A=services/sanctum/assets/default kind out
  if [ ! -f "$W/regen.npz" ]; then
    mkdir -p "$W/packed" && cp -r "$A/target" "$W/packed/target"
    REGEN_COUNT=${REGEN_COUNT_FT:-320} REGEN_HOLDOUT=32 regen
  fi
  for kind in dflash2 dflash; do
    out="$W/ft-$kind"
    run $PY train drafter --target "$A/target" --data "$CORPUS" --regen-data "$W/regen.npz" \
      --init "$INIT" --sliding-window "$FT_WINDOW" --is-causal false --kind "$kind" --out "$out" \
      --block-sizes 8,16 --seq-len "$SEQ" --batch "$BATCH" --rows-per-seq 1024 --regen-frac 0.5 \
      --steps "$STEPS" --time-budget "$FT_S" --save-every 60 --lr 5e-4 --warmup 20 \
      --eval-every 100 --log-every 10 --distill 0.5 --hard-labels target --select tau \
      --dtype float32 --target-dtype float32
    run $PY train pack --target "$A/target" --drafter "$out" --out "$W/packed-$kind" \
      --drafter-only --drafter-bits 8
  done
}

gpu_regen() {  # parts of 256 (batch 64 failed a CUDA graph launch), the first with 32 held out
  local part hold
  for ((part = 0; part < GPU_PARTS; part++)); do
    hold=0; [ $part = 0 ] && hold=$PART_HOLDOUT
    run $PY train regen --target services/sanctum/assets/default/target --data "$CORPUS" \
      --out "$W/regen-gpu-$part.npz" --count "$PART_COUNT" --holdout $hold --seq-len "$SEQ" --spans 8 \
      --new-tokens 128 --temperatures 0,0,0.7,1 --batch 32 --seed $((SEED0 + part))
  done
  merge "$W/regen-gpu.npz" $(seq -f "$W/regen-gpu-%g.npz" 0 $((GPU_PARTS - 1)))
}

review_regen() {  # parts of 256 review chats (bench multiturn's shape), the first with 32 held out
  local part hold
  for ((part = 0; part < REVIEW_PARTS; part++)); do
    hold=0; [ $part = 0 ] && hold=$PART_HOLDOUT
    run $PY train regen --target services/sanctum/assets/default/target --data "$CORPUS" \
      --out "$W/review-$part.npz" --count "$PART_COUNT" --holdout $hold --seq-len "$SEQ" --spans 8 \
      --new-tokens 128 --temperatures 0,0,0.7,1 --batch 32 --seed $((SEED0 + 50 + part)) --review
  done
  merge "$W/regen-chat.npz" "$W/regen-gpu.npz" $(seq -f "$W/review-%g.npz" 0 $((REVIEW_PARTS - 1)))
}

merge() {  # merge OUT PART...: training rows of all parts, held-out rows of every part that has them
  python3 - "$@" <<'PY'
import json, sys
import numpy as np
out, parts = sys.argv[1], sys.argv[2:]
zs = [dict(np.load(p)) for p in parts]
merged = {k: np.concatenate([z[k] for z in zs]) for k in ("train", "train_generated", "kinds", "temperatures")}
held = [z for z in zs if "holdout" in z and len(z["holdout"])]
if held:
    merged.update(holdout=np.concatenate([z["holdout"] for z in held]),
                  holdout_generated=np.concatenate([z["holdout_generated"] for z in held]))
from sanctum.train.regen import KINDS
kinds = {k: int((merged["kinds"] == i).sum()) for i, k in enumerate(KINDS)}  # of all parts
info = json.loads(str(zs[0]["info"])) | {"parts": parts, "kinds": kinds}
np.savez_compressed(out, **merged, info=np.array(json.dumps(info)))
PY
}

refine() {
  local A=services/sanctum/assets/default
  refine_step "$A/drafter" "$W/refine1" 3e-4 "$REFINE1_S"
  refine_step "$W/refine1" "$W/refine2" 2.5e-4 "$REFINE2_S"
  run $PY train pack --target "$A/target" --drafter "$W/refine2" --out "$W/packed-dflash2" \
    --drafter-only --drafter-bits 8
  run $PY train calibrate --target "$A/target" --drafter "$W/packed-dflash2/drafter" \
    --regen-data "$W/regen-gpu.npz" --write
}

refine_step() {  # refine_step INIT OUT LR BUDGET
  run $PY train drafter --target services/sanctum/assets/default/target --data "$CORPUS" \
    --regen-data "$W/regen-gpu.npz" --init "$1" --kind dflash2 --out "$2" --block-sizes 8,16 \
    --seq-len "$SEQ" --batch "$BATCH" --rows-per-seq 1024 --regen-frac 0.6 --steps "$STEPS" \
    --time-budget "$4" --save-every 60 --lr "$3" --warmup 20 --eval-every 100 --log-every 10 \
    --distill 0.5 --hard-labels target --select tau --dtype float32 --target-dtype float32
}

short_regen() {  # batch 32: at 64 MLX CUDA failed a kernel launch ("invalid argument") here too
  local A=services/sanctum/assets/default
  run $PY train regen --target "$A/target" --data "$CORPUS" --out "$W/short.npz" \
    --count "$SHORT_COUNT" --holdout 64 --seq-len 256 --spans 1 --prompt-len 96 --new-tokens 160 \
    --temperatures 0,0,0.7,1 --batch 32 --seed "$SEED0"
}

mixed() {
  local A=services/sanctum/assets/default
  run $PY train drafter --target "$A/target" --data "$CORPUS" --regen-data "$REGEN" \
    --short-data "$W/short.npz" --short-every 4 --short-batch 64 --init "$A/drafter" \
    --kind dflash2 --out "$MIXED_OUT" --block-sizes 8,16 --seq-len "$SEQ" --batch "$BATCH" \
    --rows-per-seq 1024 --regen-frac 0.6 --steps "$STEPS" --time-budget "$MIXED_S" \
    --save-every 60 --lr "$MIXED_LR" --warmup 20 --eval-every 100 --log-every 10 \
    --distill "$MIXED_DISTILL" --hard-labels target --select tau --dtype float32 \
    --target-dtype float32
  run $PY train pack --target "$A/target" --drafter "$MIXED_OUT" --out "$MIXED_OUT-packed" \
    --drafter-only --drafter-bits 8
  run $PY train calibrate --target "$A/target" --drafter "$MIXED_OUT-packed/drafter" \
    --regen-data "$REGEN" --write
}

all() { target && drafters; }

cmd=${1:?usage: train.sh target|drafters|all|install|finetune|gpu-regen|refine|short-regen|review-regen|mixed}
"${cmd//-/_}"
