"""Baseline (plain decoding) answers with the ChatML template (Qwen3).

Default head version: EAGLE-3 (--no-eagle3 for EAGLE-1/2 heads), because Qwen3 heads are EAGLE-3.
Defaults: --total-token 32 --depth 8 --top-k 4 --temperature 1.0 (as the reference script).

With --ea-model-path the baseline uses the same engine's plain decoding (the fairest comparison);
without it only the base model is loaded and Hugging Face generate is used.

Example::

    python -m eagle.evaluation.gen_baseline_answer_qwen3 --base-model-path BASE --ea-model-path HEAD --bench-name mt_bench
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="qwen3", method="baseline", use_eagle3=True, model_id="qwen3-baseline",
    total_token=32, depth=8, top_k=4, temperature=1.0,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_baseline_answer_qwen3")
