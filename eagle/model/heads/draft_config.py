"""Draft-head configuration (`EConfig`, the reference's name), the LLaMA-style config that EAGLE heads ship as
`config.json`."""

from __future__ import annotations

from transformers import LlamaConfig


class EConfig(LlamaConfig):
    """Configuration of an EAGLE draft head.

    It is a LLaMA config plus the EAGLE fields, read from the head's `config.json` exactly as published:

    - ``draft_vocab_size`` (EAGLE-3): size of the draft vocabulary (``Vd``); equal to ``vocab_size`` for a
      full-vocabulary head.
    - ``target_hidden_size`` (EAGLE-3, optional): hidden size of the target when it differs from the head's.
    - ``bias`` (EAGLE-1/2, default true): whether the head's ``fc`` layer has a bias.
    - ``qkv_bias`` (EAGLE-1/2, optional): q/k/v projection biases (Qwen2 heads).
    - ``rope_theta`` / ``rope_scaling``: the head's RoPE, handled like transformers' LLaMA (linear, dynamic,
      llama3 ... scaling all work); the base defaults to 10000 as in the reference.
    - ``eagle_aux_hidden_state_layer_ids`` (optional, EAGLE-3): the target layers whose *input* hidden states
      feed the head, as vLLM and llama.cpp read them; the default is ``[2, L // 2, L - 3]``. Also read: this
      project's older ``eagle_layer_ids`` (same meaning) and SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids``
      (the layers whose *output* feeds the head: one less). :func:`head_layer_ids` resolves them.

    Fields of other publishers' layouts, read by :mod:`eagle.model.heads.layouts` (speculators' nested
    ``transformer_layer_config`` is flattened first): ``norm_before_residual`` and ``norm_before_fc`` (speculators,
    vLLM), ``eagle_config.use_aux_hidden_state`` (false: no ``fc``, the target's final hidden state is read), a
    null ``draft_vocab_size`` (the full vocabulary), ``num_hidden_layers`` > 1 (``layers.<i>.*``); and, set from
    the checkpoint's tensors, ``fc_bias``, ``qkv_bias``, ``o_proj_bias``, ``mlp_bias`` and
    ``lm_head_from_target`` (no ``lm_head``: the target's is used).

    :func:`to_engine_layout` turns a head config into the layout vLLM, SGLang, llama.cpp and SpecForge read.
    """

    model_type = "llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    def to_dict(self):
        output = super().to_dict()
        # The reference reads `rope_theta` at the top level; write it there too so heads we save load anywhere.
        rope = output.get("rope_parameters") or {}
        if "rope_theta" in rope:
            output.setdefault("rope_theta", rope["rope_theta"])
        return output


# The architecture name SGLang registers EAGLE-3 drafts under (vLLM and llama.cpp's converter accept it too).
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def head_layer_ids(config) -> list[int] | None:
    """The target layers whose input hidden states feed an EAGLE-3 head (indices into HF ``output_hidden_states``),
    from any layout a head ships in, or None when the config names none (then ``[2, L // 2, L - 3]`` applies)."""
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_layer_ids"):
        ids = getattr(config, key, None)
        if ids:
            return [int(i) for i in ids]
    nested = getattr(config, "eagle_config", None) or {}
    ids = nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None
    if ids:  # SGLang / SpecForge count the layer whose output is read: the input of the next one
        return [int(i) + 1 for i in ids]
    return None


def to_engine_layout(config, layer_ids: list[int], target_hidden_size: int | None = None):
    """Rewrite an EAGLE-3 head config (in place; returned) into the layout the serving engines read:

    - ``architectures: ["LlamaForCausalLMEagle3"]`` (SGLang's registry, SpecForge's writer);
    - ``eagle_aux_hidden_state_layer_ids``: input-of-layer ids, read at the top level by vLLM
      (``get_eagle3_aux_layers_from_config``) and llama.cpp's ``convert_hf_to_gguf.py``;
    - ``eagle_config.eagle_aux_hidden_state_layer_ids``: the same layers as output-of-layer ids (one less), read
      by SGLang (``set_eagle3_layers_to_capture`` adds one) and written by SpecForge; ``use_aux_hidden_state``;
    - ``target_hidden_size`` and ``norm_before_residual: false`` (this head normalises the features after taking
      the residual, as the reference);
    - this project's older ``eagle_layer_ids`` removed (it is still read).
    """
    ids = [int(i) for i in layer_ids]
    if len(ids) != 3 or min(ids) < 0:
        raise ValueError(f"An EAGLE-3 head reads three target layers (indices >= 0); got {ids}.")
    config.architectures = [EAGLE3_ARCHITECTURE]
    config.eagle_aux_hidden_state_layer_ids = ids
    config.eagle_config = {"use_aux_hidden_state": True}
    if min(ids) >= 1:  # the embedding output (id 0) has no output-of-layer id: SGLang then uses its default
        config.eagle_config["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]
    config.target_hidden_size = int(target_hidden_size or getattr(config, "target_hidden_size", None)
                                    or config.hidden_size)
    config.norm_before_residual = False
    if hasattr(config, "eagle_layer_ids"):
        del config.eagle_layer_ids
    return config
