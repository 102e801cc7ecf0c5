"""Baseline (plain decoding) answers with FastChat's Vicuna v1.1 template.

Default head version: EAGLE-1/2 (--use-eagle3 for EAGLE-3 heads), because the published Vicuna heads are EAGLE-1/2.
Defaults: --total-token 60 --depth 5 --top-k 10 --temperature 1.0 (as the reference script).

With --ea-model-path the baseline uses the same engine's plain decoding (the fairest comparison);
without it only the base model is loaded and Hugging Face generate is used.

Example::

    python -m eagle.evaluation.gen_baseline_answer_vicuna --base-model-path BASE --ea-model-path HEAD --bench-name mt_bench
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="vicuna", method="baseline", use_eagle3=False, model_id="vicuna-baseline",
    total_token=60, depth=5, top_k=10, temperature=1.0,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_baseline_answer_vicuna")
