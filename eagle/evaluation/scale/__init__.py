"""The scale benchmark's models: the embedded pair (SmolLM2-135M-Instruct and its EAGLE-3 head) widened,
function-preservingly, into the shapes of the models CPU users run (~2B, 8B), so that EAGLE's acceptance is the
embedded head's while every forward pass costs what the big shape costs.

``python -m eagle.evaluation.scale build --shape 2b`` writes ``~/.cache/eagle/scale/2b/model`` (a Hugging Face
Llama directory: config.json, generation_config.json, tokenizer files, safetensors shards with an index) and
``~/.cache/eagle/scale/2b/head`` (the widened EAGLE-3 head). Those directories are what the later steps read:
llama.cpp's ``convert_hf_to_gguf.py`` turns the model directory into a GGUF file (f16) and ``llama-quantize``
makes its Q4_K_M; the head directory loads with ``EaModel.from_pretrained(ea_model_path=...)``.

``--family qwen2`` / ``--family qwen2_moe --shape moe-2b`` write the same function as a Qwen2 or a Qwen2-MoE model
(``~/.cache/eagle/scale/<family>-<shape>``).

:mod:`eagle.evaluation.scale.widen` holds the widening (the rules, the families and the shapes, ``SHAPES``);
:mod:`eagle.evaluation.scale.build` writes the directories tensor by tensor.
"""
