"""What the two draft heads have in common: the forward contract, the RoPE positions, and embedding loading."""

from __future__ import annotations

import torch
from torch import nn

from .draft_layers import DraftRotary, KVPair, causal_mask_with_past


class DraftHead(nn.Module):
    """Base class of the EAGLE heads (``cnets.Model`` for EAGLE-3, ``cnets1.Model`` for EAGLE-1).

    A head maps (target feature of position t, token t+1) pairs to a hidden state from which it predicts token
    t+2. Its contract, used by the drafter and by the trainer:

    - ``forward(hidden_states, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
      use_cache=False)`` returns the pre-norm hidden state (B, T, H), and with ``use_cache`` also the list of
      per-layer (key, value) pairs over past + new positions;
    - ``compute_logits(hidden)`` returns draft logits (B, T, Vd);
    - ``draft_to_target(ids)`` maps draft-vocabulary indices to target token ids.
    """

    eagle_version: int = 0

    def __init__(self, config, total_tokens: int = 63, depth: int = 5, top_k: int = 8, threshold: float = 1.0):
        super().__init__()
        self.config = config
        self.rotary_emb = DraftRotary(config)
        # Tree settings kept on the head for compatibility with the reference (`ea_layer.total_tokens`...).
        self.total_tokens = total_tokens - 1
        self.depth = depth
        self.top_k = top_k
        self.threshold = threshold

    # -- subclasses implement these -------------------------------------------------------------------------
    @property
    def feature_size(self) -> int:
        """Last dimension of the target features this head consumes."""
        raise NotImplementedError

    def layers_forward(self, hidden, embeds, cos, sin, attention_mask, past_key_values):
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    # -- shared ---------------------------------------------------------------------------------------------
    def forward(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: list[KVPair] | None = None,
        use_cache: bool = False,
    ):
        """hidden_states: (B, T, feature_size or H), in any floating dtype (cast to the head's); input_ids: (B, T);
        attention_mask: bool (1 or B, 1, T, past + T) or None (causal); position_ids: (B, T), default
        past..past+T-1."""
        past_len = past_key_values[0][0].shape[2] if past_key_values else 0
        bsz, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + length, device=input_ids.device)[None].expand(bsz, -1)
        if attention_mask is None and past_len > 0:
            attention_mask = causal_mask_with_past(length, past_len, input_ids.device)
        hidden_states = hidden_states.to(self.fc.weight.dtype)  # the head may run in another dtype than its target
        embeds = self.embed_tokens(input_ids).to(hidden_states.dtype)
        cos, sin = self.rotary_emb(hidden_states, position_ids)
        hidden, new_past = self.layers_forward(hidden_states, embeds, cos, sin, attention_mask, past_key_values)
        return (hidden, new_past) if use_cache else hidden

    def tie_embedding(self, embedding: nn.Embedding) -> None:
        """Use the target's input embedding (shared, not copied) when the checkpoint has none."""
        if embedding.weight.shape != self.embed_tokens.weight.shape:
            raise ValueError(
                f"The base model's input embedding has shape {tuple(embedding.weight.shape)} but the draft head "
                f"expects {tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size of its config.json): "
                "this head was not trained for this base model."
            )
        self.embed_tokens.weight = embedding.weight
        self.embed_tokens.weight.requires_grad_(False)


def load_embedding_from_checkpoint(path: str, vocab_size: int, hidden_size: int) -> torch.Tensor:
    """Read the input embedding of a target checkpoint (a local directory or a Hub id).

    Supports sharded and single-file checkpoints, safetensors or ``pytorch_model.bin`` (``weights_only``).
    """
    from .checkpoint import read_tensor_from_model

    for name in ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        tensor = read_tensor_from_model(path, name)
        if tensor is not None:
            if tuple(tensor.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"The embedding in {path} has shape {tuple(tensor.shape)}, expected ({vocab_size}, {hidden_size})."
                )
            return tensor.float()
    raise FileNotFoundError(f"No input embedding (model.embed_tokens.weight) found in the checkpoint at {path}.")
