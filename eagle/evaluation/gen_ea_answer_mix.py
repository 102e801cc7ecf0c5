"""EAGLE answers with the Llama-2 template without system prompt (Mixtral-Instruct).

Default head version: EAGLE-1/2 (--use-eagle3 for EAGLE-3 heads), because the published Mixtral head is EAGLE-1/2.
Defaults: --total-token 60 --depth 5 --top-k 10 --temperature 1.0 (as the reference script).

Example::

    python -m eagle.evaluation.gen_ea_answer_mix --base-model-path BASE --ea-model-path HEAD --bench-name mt_bench
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="mix", method="eagle", use_eagle3=False, model_id="mix-ea",
    total_token=60, depth=5, top_k=10, temperature=1.0,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_ea_answer_mix")
