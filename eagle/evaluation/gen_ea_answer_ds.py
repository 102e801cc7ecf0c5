"""EAGLE answers with the tokenizer's chat template, first turn only (DeepSeek-R1-Distill-Llama).

Default head version: EAGLE-3 (--no-eagle3 for EAGLE-1/2 heads), because the DeepSeek-R1-Distill head is EAGLE-3.
Defaults: --total-token 60 --depth 5 --top-k 10 --temperature 0.0 (as the reference script).

Example::

    python -m eagle.evaluation.gen_ea_answer_ds --base-model-path BASE --ea-model-path HEAD --bench-name mt_bench
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="ds", method="eagle", use_eagle3=True, model_id="ds-ea",
    total_token=60, depth=5, top_k=10, temperature=0.0,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_ea_answer_ds")
