#!/usr/bin/env bash
# Self-distillation data and training for the shipped head on a lent GPU (the device tool), in two calls
# while the machine stays warm: the embedded GGUF (98 MB) travels in two parts, as the tool moves 64 MiB a call.
#
#   here:    split the GGUF into .carry/p1 + .carry/p2, xz the shipped data into .carry/, the gguf wheel in .whl/,
#            the target's tokenizer files in .carry/tok/ (see docs/heads.md, "On a lent GPU", for the commands)
#   call 1:  bash scripts/gpu_distill.sh stash     carry .carry/p1 .carry/commercial.jsonl.xz .carry/tok .carry/head .whl
#            (keeps them in $STASH and runs the whole pipeline on a tiny random model: a smoke test)
#   call 2:  bash scripts/gpu_distill.sh run       carry .carry/p2
#            (data for DATA_S seconds, training for TRAIN_S seconds, everything worth keeping under $OUT)
#
# Environment: DATA_S (default 250), TRAIN_S (220), BATCH (1024 rows of `eyas data`), TRAIN_TOKENS (16384), LR (4e-4).
# The shipped head (the start of training) is stashed by call 1 too, so call 2's tree can leave it out.
set -u -o pipefail
STASH=${STASH:-/root/eyas-stash}
OUT=${OUT:-/tmp/eyas-out}
WORK=${WORK:-/tmp/eyas-work}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONUNBUFFERED=1 EYAS_CACHE=$WORK/cache PYTHONPATH=$STASH/site:$PWD EYAS_GGUF_BLOCKS=0
mkdir -p "$STASH" "$OUT" "$WORK"
t0=$(date +%s)
stamp() { echo "[gpu_distill $(( $(date +%s) - t0 ))s] $*"; }

stash() {
    mkdir -p "$STASH/tok" "$STASH/head" && cp .carry/p1 .carry/commercial.jsonl.xz "$STASH"/ || return 1
    cp .carry/tok/* "$STASH/tok/" && cp .carry/head/* "$STASH/head/" || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STASH/site" \
        .whl/*.whl || return 1
    xz -dc "$STASH/tok/tokenizer.json.xz" > "$STASH/tok/tokenizer.json"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'accelerate', accelerate.__version__, torch.cuda.is_available())"
    smoke
}

smoke() {  # the pipeline on a tiny random Llama with the target's tokenizer: data (Magpie) -> train -> export
    local tiny=$WORK/tiny
    python3 - "$STASH/tok" "$tiny" <<'EOF' || return 1
import json, shutil, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
tok, out = sys.argv[1:3]
cfg = json.load(open(f"{tok}/config.json"))
cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")})).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f"{tok}/{f}", out)
EOF
    stamp "tiny model built"
    python3 -m eyas data --prompts magpie --limit 48 --model "$tiny" --device "${DEVICE:-cuda}" --batch-size 32 \
        --prefill-rows 16 --max-new-tokens 24 --magpie-max-tokens 24 --max-slots 256 --seed 0 \
        --out "$WORK/smoke.jsonl" || return 1
    stamp "smoke data: $(wc -l < "$WORK/smoke.jsonl") conversations"
    # a random model's text is not chat-template stable: train on real conversations (the shipped data's first)
    xz -dc "$STASH/commercial.jsonl.xz" | head -n 200 > "$WORK/smoke-train.jsonl"
    python3 -m eyas train --data "$WORK/smoke-train.jsonl" --model "$tiny" --out "$WORK/smoke-run" --max-steps 6 \
        --draft-vocab 512 --batch-tokens 2048 --max-len 256 --holdout 4 --eval-tokens 16 --eval-every 3 \
        --save-every 3 --time-budget 60 --target-dtype bfloat16 --mixed-precision bf16 || return 1
    python3 -m eyas train --data "$WORK/smoke-train.jsonl" --model "$tiny" --out "$WORK/smoke-run2" --max-steps 2 \
        --init-head "$WORK/smoke-run/head" --batch-tokens 2048 --max-len 256 --holdout 4 --eval-tokens 16 \
        --target-dtype bfloat16 --mixed-precision bf16 || return 1
    stamp "SMOKE OK"
}

run() {
    local gguf=$WORK/model/SmolLM2-135M-Instruct.Q4_1.gguf data=$WORK/distill.jsonl run=$WORK/run
    mkdir -p "$(dirname "$gguf")"
    cat "$STASH/p1" .carry/p2 > "$gguf"
    echo "$GGUF_SHA  $gguf" | sha256sum -c - || return 1
    python3 -c "from eyas.models.loading import resolve_model_dir as r; print(r('$gguf'))" || return 1
    stamp "target converted"
    # the shipped data first: its Magpie ids are the dedupe set, so the GPU adds new requests only
    [ -s "$data" ] || xz -dc "$STASH/commercial.jsonl.xz" > "$data"
    local before; before=$(wc -l < "$data")
    timeout -s KILL "${DATA_S:-250}" python3 -m eyas data --prompts magpie --limit 1000000 --model "$gguf" \
        --device "${DEVICE:-cuda}" --dtype bfloat16 --batch-size "${BATCH:-1024}" --prefill-rows 256 --max-slots 1024 \
        --max-new-tokens 512 --seed 1 --out "$data" 2>&1 | tr '\r' '\n' | grep -v '^ *$' | awk 'NR % 20 == 1'
    stamp "data: $before -> $(wc -l < "$data") conversations"
    python3 - "$data" "$before" <<'EOF' | tee "$OUT/data_summary.json"
import json, sys
n = tok = 0
for i, line in enumerate(open(sys.argv[1])):
    try:
        r = json.loads(line)
    except ValueError:  # a line cut by the kill: eyas data drops it on resume, training skips it
        continue
    if i >= int(sys.argv[2]):
        n += 1
        tok += sum(t.get("completion_tokens", 0) for t in [r.get("usage", {})])
print(json.dumps({"new_conversations": n, "new_assistant_tokens": tok}))
EOF
    head -n -1 "$data" | xz -T0 -6 > "$OUT/distill-gpu.jsonl.xz"  # the last line may be cut by the kill
    stamp "data packed: $(du -h "$OUT/distill-gpu.jsonl.xz" | cut -f1)"
    python3 -m eyas train --data "$data" --model "$gguf" --out "$run" --kind eagle3 --ttt-steps 3 \
        --init-head "$STASH/head" --max-len 1024 --batch-tokens "${TRAIN_TOKENS:-16384}" \
        --lr "${LR:-4e-4}" --warmup-steps 20 --epochs 4 --time-budget "${TRAIN_S:-220}" --save-every 100000 \
        --eval-every 100000 --holdout 24 --seed 0 --target-dtype bfloat16 --mixed-precision bf16 2>&1 \
        | tr '\r' '\n' | grep -v '^ *$' | awk '/held-aside|trained|rror|Trace|^  File/ || NR % 25 == 1'
    stamp "trained"
    split -b 15000000 "$run/head/model.safetensors" "$OUT/head.safetensors.part-"
    tar -C "$run" -czf "$OUT/meta.tar.gz" head/config.json train_log.jsonl train_summary.json train_config.json \
        train_curve.png
    cat "$run/train_summary.json"
    stamp "done"
}

"$@" 2>&1 | tee -a "$OUT/run.log"
