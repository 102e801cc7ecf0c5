"""Baseline (plain decoding) answers for any chat model, prompted with the tokenizer's own chat template (``--template auto``).

Without --base-model-path it uses the embedded default model.
Default head version: EAGLE-3 (--no-eagle3 for EAGLE-1/2 heads). Tree settings default to the loader's own
(pass --total-token/--depth/--top-k to override); --template picks any other template (vicuna, llama2chat...).

Example::

    python -m eagle.evaluation.gen_baseline_answer --bench-name mt_bench --question-end 10 --max-new-token 256
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="auto", method="baseline", use_eagle3=True, model_id="baseline",
    total_token=None, depth=None, top_k=None, temperature=0.0, default_models=True,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_baseline_answer")
