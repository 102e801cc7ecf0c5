"""The EAGLE draft heads: what they have in common (:class:`DraftHead`: the forward contract, the RoPE positions,
embedding loading), the EAGLE-3 head and the EAGLE-1/2 head."""

from __future__ import annotations

import torch
from torch import nn

from eagle.model.heads.draft_layers import (DraftRotary, Eagle1DecoderLayer, Eagle3DecoderLayer, KVPair, RMSNorm,
                           causal_mask_with_past)


class DraftHead(nn.Module):
    """Base class of the EAGLE heads (:class:`Eagle3DraftHead`, :class:`Eagle1DraftHead`). A head is the network
    alone: the tree it drafts is ``EaModel.tree_settings`` (see :mod:`eagle.model.tuning.head_tree`).

    A head maps (target feature of position t, token t+1) pairs to a hidden state from which it predicts token
    t+2. Its contract, used by the drafter and by the trainer:

    - ``forward(hidden_states, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
      use_cache=False)`` returns the pre-norm hidden state (B, T, H), and with ``use_cache`` also the list of
      per-layer (key, value) pairs over past + new positions;
    - ``compute_logits(hidden)`` returns draft logits (B, T, Vd);
    - ``draft_to_target(ids)`` maps draft-vocabulary indices to target token ids.
    """

    eagle_version: int = 0

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary_emb = DraftRotary(config)

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

    @property
    def weight(self) -> torch.Tensor:
        """A floating weight of the head's own (its device and dtype are the head's)."""
        return self.fc.weight

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
        hidden_states = hidden_states.to(self.weight.dtype)  # the head may run in another dtype than its target
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


def reads_aux_hidden_states(config) -> bool:
    """Whether an EAGLE-3 head fuses three target layers through ``fc`` (``eagle_config.use_aux_hidden_state``,
    default true, as vLLM and SGLang read it) rather than reading the target's final hidden state."""
    nested = getattr(config, "eagle_config", None) or {}
    return bool(nested.get("use_aux_hidden_state", True)) if isinstance(nested, dict) else True


class Eagle3DraftHead(DraftHead):
    """EAGLE-3 head (the reference's ``cnets.Model``): a decoder layer over (embedding, fused target features),
    with its own LM head over a draft vocabulary of ``draft_vocab_size`` tokens mapped to target ids through
    ``d2t``. State-dict keys: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and
    optionally ``embed_tokens`` (see EAGLE_SPEC section 3.3).

    The variants published heads use (read by :mod:`eagle.model.heads.layouts`): ``fc`` with a bias
    (``fc_bias``); ``norm_before_fc`` (an RMSNorm ``input_norm`` over the fused features before ``fc``);
    ``norm_before_residual``; no ``fc`` when ``eagle_config.use_aux_hidden_state`` is false (the head reads the
    target's final hidden state); further decoder layers ``layers.1 ...`` (``num_hidden_layers`` > 1, standard
    LLaMA layers after the first, as vLLM and speculators run them); a null ``draft_vocab_size`` (the full
    vocabulary), with the target's LM head when the checkpoint has none (``lm_head_from_target``)."""

    eagle_version = 3

    def __init__(self, config, load_emb=False, path=None, bias=True, total_tokens=63, depth=5, top_k=8, threshold=1.0):
        super().__init__(config)  # the tree arguments: the reference's signature (cnets.Model), unused here
        hidden = config.hidden_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or hidden
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.reads_aux_hidden_states = reads_aux_hidden_states(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)
        fused = 3 * self.target_hidden_size
        if getattr(config, "norm_before_fc", False):
            self.input_norm = RMSNorm(fused, eps=config.rms_norm_eps)
        self.fc = (nn.Linear(fused, hidden, bias=bool(getattr(config, "fc_bias", False)))
                   if self.reads_aux_hidden_states else None)
        self.midlayer = Eagle3DecoderLayer(config)
        layers = int(getattr(config, "num_hidden_layers", 1) or 1)
        if layers > 1:
            self.layers = nn.ModuleDict({str(i): Eagle1DecoderLayer(config, i) for i in range(1, layers)})
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self._target_lm_head: list[nn.Module] = []  # the target's, when the checkpoint has none (not registered)
        self.lm_head = (None if getattr(config, "lm_head_from_target", False)
                        else nn.Linear(hidden, self.draft_vocab_size, bias=False))
        #: the decoder layer in one native call (a HeadLayerPlan of eagle.model.heads.native), set where the head
        #: is quantized and the layer allows it; None: its modules
        self.native_layer = None
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        if load_emb and path is not None:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(load_embedding_from_checkpoint(path, config.vocab_size, hidden))

    @property
    def feature_size(self) -> int:
        return 3 * self.target_hidden_size if self.reads_aux_hidden_states else self.config.hidden_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    @property
    def weight(self) -> torch.Tensor:
        """A floating weight of the head's own (its device and dtype are the head's)."""
        return self.midlayer.self_attn.q_proj.weight

    def attach_target_lm_head(self, lm_head: nn.Module) -> None:
        """The target's LM head, for a head whose checkpoint has none (``lm_head_from_target``)."""
        self._target_lm_head[:] = [lm_head]

    def layers_forward(self, hidden, embeds, cos, sin, attention_mask, past_key_values):
        if self.fc is not None and hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fuse(hidden)  # target features (B, T, 3 Ht) -> (B, T, H); draft states pass as they are
        past = past_key_values or [None] * (1 + len(getattr(self, "layers", ())))
        if self.native_layer is not None and hidden.dtype == torch.float32 and not torch.is_grad_enabled():
            hidden, present = self.native_layer(embeds, hidden, cos, sin, attention_mask, past[0])
            return hidden, [present]
        hidden, present = self.midlayer(embeds, hidden, cos, sin, attention_mask, past[0])
        presents = [present]
        for i, layer in enumerate(getattr(self, "layers", {}).values(), 1):
            hidden, present = layer(hidden, cos, sin, attention_mask, past[i])
            presents.append(present)
        return hidden, presents

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (B, T, 3 Ht) -> (B, T, H): ``input_norm`` (``norm_before_fc``), then ``fc``."""
        if hasattr(self, "input_norm"):
            features = self.input_norm(features)
        return self.fc(features)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(normed)
        if not self._target_lm_head:
            raise RuntimeError("This EAGLE-3 head drafts with the target's LM head; none is attached "
                               "(call attach_target_lm_head).")
        head = self._target_lm_head[0]
        return head(normed.to(head.weight.dtype))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.reduced_vocab:
            return ids
        return ids + self.d2t[ids]

class Eagle1DraftHead(DraftHead):
    """EAGLE-1/EAGLE-2 head (the reference's ``cnets1.Model``): ``fc`` over (embedding, target final hidden
    state), a few LLaMA decoder layers, and the target's own LM head for logits. State-dict keys: ``embed_tokens``, ``fc`` (bias unless ``"bias": false``), ``layers.i.*``."""

    eagle_version = 1

    def __init__(self, config, load_emb=False, path=None, bias=True, total_tokens=63, depth=5, top_k=8, threshold=1.0):
        super().__init__(config)  # the tree arguments: the reference's signature (cnets.Model), unused here
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.layers = nn.ModuleList(Eagle1DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self._target_lm_head: list[nn.Module] = []  # a list so the target head is not registered as a submodule
        if load_emb and path is not None:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(load_embedding_from_checkpoint(path, config.vocab_size, hidden))

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size

    def attach_target_lm_head(self, lm_head: nn.Module) -> None:
        """EAGLE-1 drafts with the target's LM head; ``EaModel`` attaches it after loading."""
        self._target_lm_head[:] = [lm_head]

    def layers_forward(self, hidden, embeds, cos, sin, attention_mask, past_key_values):
        hidden = self.fc(torch.cat([embeds, hidden], dim=-1))
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, present = layer(hidden, cos, sin, attention_mask, past_key_values[i] if past_key_values else None)
            presents.append(present)
        return hidden, presents

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._target_lm_head:
            raise RuntimeError("This EAGLE-1 head has no target LM head attached (call attach_target_lm_head).")
        head = self._target_lm_head[0]
        return head(hidden.to(head.weight.dtype))

def load_embedding_from_checkpoint(path: str, vocab_size: int, hidden_size: int) -> torch.Tensor:
    """Read the input embedding of a target checkpoint (a local directory or a Hub id).

    Supports sharded and single-file checkpoints, safetensors or ``pytorch_model.bin`` (``weights_only``).
    """
    from eagle.model.heads.checkpoint import read_tensor_from_model

    for name in ("model.embed_tokens.weight", "embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        tensor = read_tensor_from_model(path, name)
        if tensor is not None:
            if tuple(tensor.shape) != (vocab_size, hidden_size):
                raise ValueError(
                    f"The embedding in {path} has shape {tuple(tensor.shape)}, expected ({vocab_size}, {hidden_size})."
                )
            return tensor.float()
    raise FileNotFoundError(f"No input embedding (model.embed_tokens.weight) found in the checkpoint at {path}.")
