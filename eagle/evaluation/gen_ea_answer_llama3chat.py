"""EAGLE answers with the tokenizer's Llama-3 chat template with a system prompt.

Default head version: EAGLE-1/2 (--use-eagle3 for EAGLE-3 heads), because as the reference (EAGLE-1/2 unless --use_eagle3).
Defaults: --total-token 60 --depth 5 --top-k 10 --temperature 0.0 (as the reference script).

Example::

    python -m eagle.evaluation.gen_ea_answer_llama3chat --base-model-path BASE --ea-model-path HEAD --bench-name mt_bench
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="llama3chat", method="eagle", use_eagle3=False, model_id="llama3chat-ea",
    total_token=60, depth=5, top_k=10, temperature=0.0,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_ea_answer_llama3chat")
