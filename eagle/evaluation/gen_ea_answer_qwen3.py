"""EAGLE answers with the ChatML template (Qwen3).

Default head version: EAGLE-3 (--no-eagle3 for EAGLE-1/2 heads), because Qwen3 heads are EAGLE-3.
Defaults: --total-token 32 --depth 8 --top-k 4 --temperature 1.0 (as the reference script).

Example::

    python -m eagle.evaluation.gen_ea_answer_qwen3 --base-model-path BASE --ea-model-path HEAD --bench-name mt_bench
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="qwen3", method="eagle", use_eagle3=True, model_id="qwen3-ea",
    total_token=32, depth=8, top_k=4, temperature=1.0,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_ea_answer_qwen3")
