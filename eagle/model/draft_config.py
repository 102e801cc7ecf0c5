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
    - ``eagle_layer_ids`` (optional, EAGLE-3): the target layers whose *input* hidden states feed the head;
      the default is ``[2, L // 2, L - 3]``.
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
