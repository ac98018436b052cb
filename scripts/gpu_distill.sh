#!/usr/bin/env bash
# Self-distillation data and training for the shipped head on a lent GPU (the device tool), in two calls
# while the machine stays warm: the embedded GGUF (98 MB) travels in two parts, as the tool moves 64 MiB a call.
#
#   here:    bash scripts/gpu_distill.sh prepare   (the GGUF split into .carry/p1 + .carry/p2, the shipped data xz'd,
#            the shipped head (its weights xz'd), the tokenizer files, the gguf wheel in .whl/; and the big tracked
#            files taken out of git's index and excluded, so the tree stays under 64 MiB: `bash scripts/gpu_distill.sh
#            restore` after)
#   call 1:  bash scripts/gpu_distill.sh stash     carry .carry/p1 .carry/commercial.jsonl.xz .carry/tok .carry/head
#                                                  .carry/magpie .whl
#            (keeps them in $STASH and runs the whole pipeline on a tiny random model: a smoke test)
#   call 2:  bash scripts/gpu_distill.sh run       carry .carry/p2
#            (data for DATA_S seconds, then training until END_S seconds after the call began, through `eyas train
#            --wall-budget`, so loading, steps and the export end on time; everything worth keeping under $OUT)
#
# Measured on an H200 (2026-11-26, two draws, docs/heads.md): call 1 with the machine's start 123-143 s held; call 2:
# GGUF joined and converted 30 s; data 220-250 s -> 2.5-2.9 M new assistant tokens (15 k tok/s at the end, 1,024
# rows); packing 5-9 s; training loads in ~45-60 s and runs ~140 k assistant tok/s (2,904 steps, 30.3 M tokens in
# 215 s). On an H100 (third draw) a training run with data generation beside it loaded in 183 s and was killed at the
# call's 600 s limit before its export: hence --wall-budget, and data before training, not beside it. Fifth draw (an
# H200, 2026-11-27, DATA_S=60): call 1 154 s held; call 2 532 s: data 60 s -> 179 k tokens (the generator ramps up
# over its first minute, 3-5 k tok/s), training loaded in 90 s (74.7 s tokenizing on one core, since fixed) and ran
# 3,972 steps, 41 M tokens at 124 k tok/s. Sixth draw (an H200, 2026-11-27, WIDEN=2304): call 1 138 s held;
# call 2 533 s: loading 41 s (tokenizing 21.9 s), 5,631 steps, 57.7 M tokens at 133 k tok/s. Seventh draw (an H200,
# 2026-11-27, WIDEN unset): call 1 199 s held (85 s of it the command); call 2 531 s: loading 39 s, 6,096 steps,
# 62.4 M tokens at 138 k tok/s. Eighth draw (an H200, 2026-11-28, the same): call 1 128 s held (81 s the command);
# call 2 531 s: loading 34 s, 6,195 steps, 63.4 M tokens at 137.5 k tok/s. Tenth draw (an H200, 2026-11-30, PAD=64
# WIDEN=3072): call 1 176 s held (128 s the command); call 2 first refused as over 64 MiB (see LIMIT), then 532 s:
# loading 49 s, 6,508 steps, 66.4 M tokens at 150 k tok/s.
# Environment: DATA_S (default 0, no data phase: a short one is mostly ramp, docs/heads.md; 120 s gave ~1 M
# tokens), END_S (560: call 2 with timeout_s 600), BATCH (1024 rows of `eyas data`), TRAIN_TOKENS (16384), LR (4e-4),
# SEED (9: GPU draws used 1, 2, 7, 4 and 8, CPU files 3, 5, 6, 10, 11, 12, 14-21 (next: 22), the held-out
# file 13; a seed used before redraws its requests first, which the dedupe then drops). TRAIN_S, which the first two
# draws set, is gone: END_S bounds the training.
# WIDEN (unset): `eyas train --widen-mlp WIDEN`, the head's MLP widened before training (2,304 units since the sixth
# draw; the same width is a no-op), the same function at step 0; set it for both calls, call 1's smoke test uses it
# too; the head's config.json then comes from meta.tar.gz, not from the shipped head.
# VOCAB (unset): `eyas train --grow-draft-vocab VOCAB`, the head's 8,192-id draft vocabulary grown (its ids and rows
# kept, the data's most frequent other tokens added, their rows mapped from the target's; docs/heads.md "The draft
# vocabulary"), e.g. 12288 or 16384; set it for both calls, and take config.json from meta.tar.gz, as for WIDEN.
# PAD (unset): `eyas train --pad-multiple PAD`, each batch padded to a multiple of PAD tokens (e.g. 64), so the
# target's attention sees ~16 shapes instead of one per batch (the ninth draw's profile: cuDNN's attention forward took
# 1.9 ms of host time a call, and the device idled two thirds of a step; docs/heads.md). Tenth draw (PAD=64,
# WIDEN=3072): 66.6 ms a step, 153 k tok/s from step 200 on (the eighth draw's whole run 137.5 k), the early profile
# unchanged.
# LAYERS (unset): `eyas train --head-layers LAYERS`, plain Llama decoder layers added after the head's first (zero
# output weights: the same function at step 0; docs/heads.md "For the next draw"), e.g. 2; set it for both calls,
# call 1's smoke test uses it too, and take config.json from meta.tar.gz, as for WIDEN.
# The shipped head (the start of training) is stashed by call 1 too, so call 2's tree can leave it out.
set -u -o pipefail
STASH=${STASH:-/root/eyas-stash}
OUT=${OUT:-/tmp/eyas-out}
WORK=${WORK:-/tmp/eyas-work}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONUNBUFFERED=1 EYAS_CACHE=$WORK/cache PYTHONPATH=$STASH/site:$PWD
t0=$(date +%s)
stamp() { echo "[gpu_distill $(( $(date +%s) - t0 ))s] $*"; }

# tracked paths taken out of the transfer (the tree travels with each call; 64 MiB a call in all): the big files, the
# packed Magpie files (call 1 carries them once, in .carry/magpie), and the docs and tests, which neither call reads
# (0.7 MB a call: ~1 M more tokens of data fit)
BIG="data/checkpoints/eagle3-commercial/checkpoint/head.safetensors data/selfdistill/smollm2-135m-instruct.jsonl
data/selfdistill/smollm2-135m-instruct-commercial.jsonl eyas/heads/smollm2-135m-instruct-eagle3/model.safetensors
$(ls data/selfdistill/smollm2-135m-instruct-magpie-*.jsonl.xz 2>/dev/null) docs tests data/heldout
data/checkpoints/eagle3-commercial/train_log.jsonl data/checkpoints/eagle3-commercial/train_curve.png README.md
$(git ls-tree -r --name-only HEAD scripts | grep -v '^scripts/gpu_distill.sh$')"
# 64 MiB, less a margin: the tool counts a little more than these bytes (the tenth draw's call 2 was refused at
# 66,968,883 by this count, its call 1 went at 66,968,882, and call 2 went at 66,764,128 with README.md and the other
# scripts left out, as BIG now does): keep 256 KiB spare
LIMIT=$((67108864 - 262144))
bytes() { find "$@" -type f -print0 | du -cb --files0-from=- | tail -1 | cut -f1; }  # files only, not folders

prepare() {  # here, with the project's venv first on PATH
    local g d
    g=$(python -c "from eyas.models.loading import embedded_gguf_path as e; print(e())") || return 1
    d=$(python -c "from eyas.models.loading import resolve_model_dir as r; print(r(None))") || return 1
    local packed=.carry/magpie/all.jsonl.xz
    rm -rf .carry/head .carry/p1 .carry/p2 && mkdir -p .carry/tok .carry/head .carry/magpie .whl
    # every packed Magpie file as one xz stream, in the same order (run reads them as one concatenation): one
    # dictionary across files (~2-4 min): 13.5 -> 11.8 MB for the files up to cpu18; with cpu21 both calls 66.97 MB.
    # A packing newer than every Magpie file is kept (a rerun of prepare after a size miss costs seconds, not minutes)
    if [ ! -s $packed ] || [ -n "$(find data/selfdistill -name 'smollm2-135m-instruct-magpie-*.jsonl.xz' -newer $packed)" ]
    then
        xz -dc data/selfdistill/smollm2-135m-instruct-magpie-*.jsonl.xz | xz -9e -T1 > $packed.tmp \
            && mv $packed.tmp $packed || return 1
    fi
    xz -9 -c data/selfdistill/smollm2-135m-instruct-commercial.jsonl > .carry/commercial.jsonl.xz
    # the head's bf16 weights xz'd: 19.7 -> 14.0 MB (their exponent bytes compress), 2.8 MB more room in each call
    cp eyas/heads/smollm2-135m-instruct-eagle3/* .carry/head/ && xz -T0 -6 -f .carry/head/model.safetensors || return 1
    cp "$d/config.json" "$d/tokenizer_config.json" "$d/chat_template.jinja" .carry/tok/
    xz -9 -c "$d/tokenizer.json" > .carry/tok/tokenizer.json.xz
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl gguf==0.19.0 || return 1
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    # shellcheck disable=SC2086
    git rm --cached -r -q $BIG || { echo "commit (git add) every file of BIG first" >&2; return 1; }
    for f in $BIG; do echo "/$f" >> .git/info/exclude; done
    # the GGUF split where both calls carry the same: call 1 = tree + its files + p1, call 2 = tree + the rest
    local tree extras size split c1 c2
    tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
    extras=$(bytes .carry/commercial.jsonl.xz .carry/tok .carry/head .carry/magpie .whl)
    size=$(stat -c %s "$g")
    split=$(( (size - extras) / 2 ))
    [ "$split" -gt 0 ] || { echo "call 1's files alone ($extras bytes) outweigh the GGUF: carry fewer" >&2; return 1; }
    head -c "$split" "$g" > .carry/p1 && tail -c +$((split + 1)) "$g" > .carry/p2
    c1=$((tree + extras + $(stat -c %s .carry/p1)))
    c2=$((tree + $(stat -c %s .carry/p2)))
    echo "tree $tree bytes; GGUF split at $split; call 1 $c1, call 2 $c2 (limit $LIMIT)"
    [ "$c1" -lt "$LIMIT" ] && [ "$c2" -lt "$LIMIT" ] || {
        echo "a call is over 64 MiB with the split balanced: pack fewer Magpie files for call 1 (.carry/magpie)" >&2
        return 1; }
}

restore() {  # here: the big files back in the index, the exclusions gone
    # shellcheck disable=SC2086
    git reset -q $BIG
    for f in $BIG; do sed -i "\#^/$f\$#d" .git/info/exclude; done
    git status --short
}

stash() {
    mkdir -p "$STASH/tok" "$STASH/head" && cp .carry/p1 .carry/commercial.jsonl.xz "$STASH"/ || return 1
    cp .carry/tok/* "$STASH/tok/" && cp .carry/head/* "$STASH/head/" || return 1
    xz -d -f "$STASH/head/model.safetensors.xz" || return 1  # prepare packs it
    mkdir -p "$STASH/magpie" && cp .carry/magpie/* "$STASH/magpie/" || return 1
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
    python3 -m eyas train --data "$WORK/smoke-train.jsonl" --model "$tiny" --out "$WORK/smoke-run2" --max-steps 12 \
        --init-head "$WORK/smoke-run/head" ${WIDEN:+--widen-mlp "$WIDEN"} ${VOCAB:+--grow-draft-vocab "$VOCAB"} \
        ${PAD:+--pad-multiple "$PAD"} ${LAYERS:+--head-layers "$LAYERS"} \
        --batch-tokens 2048 --max-len 256 \
        --holdout 0 --eval-every 100000 --wall-budget 90 --target-dtype bfloat16 --mixed-precision bf16 \
        --profile-steps 2 || return 1
    [ -s "$WORK/smoke-run2/profile.txt" ] || { echo "smoke: no profile.txt" >&2; return 1; }
    stamp "SMOKE OK"
}

run() {
    local gguf=$WORK/model/SmolLM2-135M-Instruct.Q4_1.gguf data=$WORK/distill.jsonl run=$WORK/run
    mkdir -p "$(dirname "$gguf")"
    cat "$STASH/p1" .carry/p2 > "$gguf"
    echo "$GGUF_SHA  $gguf" | sha256sum -c - || return 1
    python3 -c "from eyas.models.loading import resolve_model_dir as r; print(r('$gguf'))" || return 1
    stamp "target converted"
    # the shipped data first (the commercial file and every packed Magpie file, GPU- or CPU-made): their Magpie ids
    # are the dedupe set, so the GPU adds new requests only; SEED differs from the earlier ones
    [ -s "$data" ] || { xz -dc "$STASH/commercial.jsonl.xz"
        for f in "$STASH"/magpie/*.jsonl.xz; do xz -dc "$f"; done; } > "$data"
    local before; before=$(wc -l < "$data")
    [ "${DATA_S:-0}" -gt 0 ] && timeout -s KILL "${DATA_S:-0}" python3 -m eyas data --prompts magpie \
        --limit 1000000 --model "$gguf" \
        --device "${DEVICE:-cuda}" --dtype bfloat16 --batch-size "${BATCH:-1024}" --prefill-rows 256 --max-slots 1024 \
        --max-new-tokens 512 --seed "${SEED:-9}" --out "$data" 2>&1 | tr '\r' '\n' | grep --line-buffered -v '^ *$' \
        | awk 'NR % 20 == 1 {print; fflush()}'
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
        tok += r.get("usage", {}).get("completion_tokens", 0)
print(json.dumps({"new_conversations": n, "new_assistant_tokens": tok}))
EOF
    # the new rows only; the last line may be cut by the kill
    tail -n +$((before + 1)) "$data" | head -n -1 | xz -T0 -6 > "$OUT/distill-gpu.jsonl.xz"
    stamp "data packed: $(du -h "$OUT/distill-gpu.jsonl.xz" | cut -f1)"
    # --wall-budget: loading, steps and the export end END_S s after this script started, whatever the loading
    # takes, and no held-aside eval runs (--holdout 0 keeps every conversation for training; tau is measured on the
    # CPU afterwards). The first draw lost its head to an eval before the export, the third to the call's limit.
    local wall=$(( ${END_S:-560} - ($(date +%s) - t0) ))
    stamp "training with --wall-budget $wall"
    python3 -m eyas train --data "$data" --model "$gguf" --out "$run" --kind eagle3 --ttt-steps 3 \
        --init-head "$STASH/head" ${WIDEN:+--widen-mlp "$WIDEN"} ${VOCAB:+--grow-draft-vocab "$VOCAB"} \
        ${PAD:+--pad-multiple "$PAD"} ${LAYERS:+--head-layers "$LAYERS"} --max-len 1024 \
        --batch-tokens "${TRAIN_TOKENS:-16384}" \
        --lr "${LR:-4e-4}" --warmup-steps 20 --epochs 4 --wall-budget "$wall" --save-every 100000 \
        --eval-every 100000 --holdout 0 --seed 0 --target-dtype bfloat16 --mixed-precision bf16 \
        --profile-steps 5 --profile-start 1000 2>&1 \
        | tr '\r' '\n' | grep --line-buffered -v '^ *$' \
        | awk '/trained|budget|loading|rror|Trace|^  File/ || NR % 100 == 1 {print; fflush()}'
    stamp "trained"
    split -b 15000000 "$run/head/model.safetensors" "$OUT/head.safetensors.part-"
    # profile.txt: steps 1000-1004 under torch.profiler, the steady state (where a step's ~67 ms go on the GPU;
    # eyas/train/profiling.py; steps 10-14, profiled by the ninth and tenth draws, took 164 ms under the profiler)
    tar -C "$run" -czf "$OUT/meta.tar.gz" head/config.json train_log.jsonl train_summary.json train_config.json \
        train_curve.png $(cd "$run" && ls profile.txt 2>/dev/null)
    cat "$run/train_summary.json"
    stamp "done"
}

case "${1:-}" in
    prepare | restore) "$@" ;;
    stash | run) mkdir -p "$STASH" "$OUT" "$WORK" && "$@" 2>&1 | tee -a "$OUT/run.log" ;;
    *) echo "usage: bash scripts/gpu_distill.sh prepare|stash|run|restore" >&2; exit 2 ;;
esac
