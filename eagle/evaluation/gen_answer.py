"""EAGLE answers for any chat model, prompted with the tokenizer's own chat template (``--template auto``).

Without --base-model-path and --ea-model-path it uses the embedded default model and head.
Default head version: EAGLE-3 (--no-eagle3 for EAGLE-1/2 heads). Tree settings default to the loader's own
(pass --total-token/--depth/--top-k to override); --template picks any other template (vicuna, llama2chat...).

Example::

    python -m eagle.evaluation.gen_answer --bench-name mt_bench --question-end 10 --max-new-token 256
"""

from eagle.evaluation.answer_script import ScriptDefaults, main

DEFAULTS = ScriptDefaults(
    template="auto", method="eagle", use_eagle3=True, model_id="ea",
    total_token=None, depth=None, top_k=None, temperature=0.0, default_models=True,
)

if __name__ == "__main__":
    main(DEFAULTS, prog="python -m eagle.evaluation.gen_answer")
