"""The target (base) model seen through one generic mechanism: a stock transformers causal LM, fed a 4-D attention
mask (tree attention) and our preallocated cache, returning logits and the hidden states EAGLE reads.

Nothing here is specific to a model family: any decoder-only model whose attention honours a 4-D mask (SDPA or
eager) works, with full, sliding-window or chunked attention layers (:mod:`eagle.model.base.families` refuses
what a tree mask cannot express), called the transformers 5 way or, for remote code, the transformers 4 way
(:mod:`eagle.model.base.model_call`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.model.heads.draft_config import head_layer_ids
from eagle.model.backends.attention import check_attention_implementation
from eagle.model.backends.linear import real_rows_only
from eagle.model.base.logits import LazyLogits, LazyProjection
from eagle.model.base.families import MASKED_LAYER_TYPES, check_attention_known
from eagle.model.base.kv_cache import TreeKVCache
from eagle.model.base.model_call import ModelCall, check_tree_attention
from eagle.model.base.plan import ForwardPlan

def eagle3_layer_ids(num_layers: int) -> list[int]:
    """Indices into HF ``output_hidden_states`` (entry i = input of layer i) that feed an EAGLE-3 head:
    ``[2, L // 2, L - 3]``, clamped to valid entries for tiny models (always three features)."""
    return [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]


def feature_layers(head, use_eagle3: bool, num_layers: int) -> list[int] | None:
    """What ``head`` reads from a target of ``num_layers`` layers: an EAGLE-3 head the inputs of three layers (its
    config's layer ids, else :func:`eagle3_layer_ids`); EAGLE-1, or an EAGLE-3 head without aux hidden states, the
    final normed hidden state (``[-1]``); no head, nothing (None)."""
    if head is None:
        return None
    if use_eagle3 and getattr(head, "reads_aux_hidden_states", True):
        return list(head_layer_ids(head.config) or eagle3_layer_ids(num_layers))
    return [-1]


def layer_types(config) -> list[str]:
    """Each layer's attention type (transformers' ``config.layer_types`` names); a config without them has full
    attention everywhere, or sliding-window attention everywhere when it sets ``sliding_window`` (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers


#: Model types whose transformers attention caches, in every layer, ``num_key_value_heads`` keys and values of
#: ``head_dim`` each in the hidden states' dtype, which is what :func:`config_slot_bytes` computes (each checked
#: against the bytes the model writes, tests/test_cache_size.py). Other families (MLA models, which cache a compressed
#: latent; families never checked) measure what one token writes.
CONFIG_SIZED_CACHES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "phi3", "gemma", "gemma3_text", "qwen2_moe",
                       "qwen3_moe", "llama4_text", "gpt_oss", "olmoe", "granitemoe", "smollm3")


def config_slot_bytes(model, dtype: torch.dtype) -> int | None:
    """Bytes one row of a :class:`TreeKVCache` holds per slot for ``model`` (hidden states of ``dtype``), from its
    text config: keys and values of ``num_key_value_heads`` x ``head_dim`` in every layer. None where the config does
    not say it: a family outside :data:`CONFIG_SIZED_CACHES`, code that is not transformers' own (remote code caches
    what it likes), a quantizer's layers (which may compute in a dtype of their own), a layer type that is not
    attention."""
    config = model.config.get_text_config()
    if (getattr(config, "model_type", None) not in CONFIG_SIZED_CACHES
            or not type(model).__module__.startswith("transformers.")
            or getattr(model, "hf_quantizer", None) is not None
            or any(kind not in MASKED_LAYER_TYPES for kind in layer_types(config))):
        return None
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def check_target_model(model) -> None:
    """Refuse what the generic mechanism cannot serve, with a message that says why."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model; EAGLE needs a decoder-only causal language model."
        )
    if model.get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} has no causal LM head; load the model with AutoModelForCausalLM.")
    check_attention_implementation(model)


# Config fields of families whose logits are not just the LM head applied to the last hidden state.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


@dataclass(frozen=True)
class TargetOutput:
    """What an entry point of :class:`Target` returns."""

    logits: torch.Tensor | LazyLogits  # (B, T', V) float: the positions kept, or lazily projected (Target.verify)
    features: torch.Tensor | None  # (B, T, F) hidden states EAGLE reads, or None when not asked for


class Target:
    """Runs the target model over new tokens at given positions, on top of a :class:`TreeKVCache`.

    Three entry points, one per kind of pass, all through one model call (:meth:`_run`): :meth:`prefill`
    (prompts, possibly a left-padded batch), :meth:`decode` (one token per row) and :meth:`verify` (a draft tree
    per row, its logits possibly projected lazily).

    ``feature_layers``: indices into ``output_hidden_states`` to concatenate (EAGLE-3: three layers; EAGLE-1:
    ``[-1]``, the final normed state), or None when no draft head reads them. ``forward_plan``: how its passes run
    (:class:`~eagle.model.base.plan.ForwardPlan`), built with the target; :meth:`replan` builds it anew.
    """

    def __init__(self, model, feature_layers: list[int] | None, allow_unknown_attention: bool = False):
        check_target_model(model)
        check_attention_known(model, allow_unknown_attention)
        self.model = model
        self.config = model.config.get_text_config()
        self.forward_plan = ForwardPlan.build(model)
        self.feature_layers = feature_layers
        self.num_layers = self.config.num_hidden_layers
        self.window = getattr(self.config, "sliding_window", None)
        self.chunk = getattr(self.config, "attention_chunk_size", None)
        self.layer_types = layer_types(self.config)
        self._slot_bytes: int | None = None
        self.device = model.get_input_embeddings().weight.device
        self.dtype = model.get_input_embeddings().weight.dtype
        # Lazy tree logits (see LazyLogits): on a CPU only (on an accelerator the whole tree's rows cost no more than
        # one), for models whose logits are the LM head of the last hidden state: known post-processing rules it
        # out, and the first prefill checks it numerically (None until then).
        postprocessed = any(getattr(self.config, name, None) not in (None, 1, 1.0) for name in LOGIT_POSTPROCESSING)
        self._lazy_logits: bool | None = None if self.device.type == "cpu" and not postprocessed else False
        if self.call.legacy and not allow_unknown_attention:
            check_tree_attention(self)  # remote code of transformers 4: its 4-D mask convention is its own
        self.slot_bytes()  # known now, so that the first generation's memory check runs nothing

    @property
    def call(self) -> ModelCall:
        """The model's forward signature (the plan's)."""
        return self.forward_plan.call

    def replan(self, kernel_attention: bool | None = None) -> None:
        """Build the forward plan anew from the model as it is now (after its linear layers moved to or off the
        GGUF kernels); ``kernel_attention`` as :meth:`ForwardPlan.build` takes it."""
        self.forward_plan = ForwardPlan.build(self.model, kernel_attention)

    def new_cache(self, capacity: int) -> TreeKVCache:
        return TreeKVCache(self.num_layers, capacity)

    def slot_bytes(self) -> int:
        """Bytes one row's cache holds per slot, over all layers: known when the target is built, from the config
        where it says them (:func:`config_slot_bytes`), else measured (:meth:`measured_slot_bytes`)."""
        if self._slot_bytes is None:
            self._slot_bytes = config_slot_bytes(self.model, self.dtype)
        if self._slot_bytes is None:
            self._slot_bytes = self.measured_slot_bytes()
        return self._slot_bytes

    def measured_slot_bytes(self) -> int:
        """Bytes one row's cache holds per slot, as a prefill of one token writes them (MLA models cache a
        compressed latent, not heads x head_dim keys and values)."""
        cache = self.new_cache(1)
        self.prefill(torch.zeros(1, 1, dtype=torch.long), cache, features=False)
        return cache.slot_bytes()

    def attention_mask(self, past: int, position_ids: torch.Tensor, tree_mask: torch.Tensor | None,
                       valid: torch.Tensor | None = None, key_positions: torch.Tensor | None = None):
        """Additive 4-D mask (B, 1, T, past + T) in the model dtype, or a dict of them per layer type.

        position_ids: (B, T) or (T,) positions of the new tokens. Every new token sees the committed slots
        (``valid`` (B, past + T) bool says which slots, the new ones included, hold a row's real tokens; None = all
        of them); among new tokens it sees what ``tree_mask`` ((B, T, T) or (T, T)) allows (ancestors and itself),
        or causally when there is no tree, and always itself (so that a padding query attends to something).
        Sliding-window layers also hide keys ``window`` or more positions back, chunked layers keys of another
        ``attention_chunk_size`` chunk of positions (``key_positions`` (B, past): the positions of the committed
        slots, default ``0 .. past - 1``); when the layers differ, a dict {layer type: mask}.
        """
        position_ids = position_ids.to(self.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        batch, length = position_ids.shape
        device = self.device
        if tree_mask is None:
            new_block = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
        else:
            new_block = tree_mask.to(device)
        new_block = new_block.expand(batch, length, length)
        allowed = torch.cat([torch.ones(batch, length, past, dtype=torch.bool, device=device), new_block], dim=2)
        if valid is not None:
            allowed = allowed & valid.to(device)[:, None, :]
            allowed[:, :, past:] |= torch.eye(length, dtype=torch.bool, device=device)
        kinds = list(dict.fromkeys(self.layer_types))
        if kinds == ["full_attention"]:
            return self._additive(allowed)
        if key_positions is None:
            key_positions = torch.arange(past, device=device).expand(batch, past)
        key_positions = torch.cat([key_positions.to(device), position_ids], dim=1)
        masks = {kind: self._additive(self._within_reach(kind, allowed, position_ids, key_positions))
                 for kind in kinds}
        return masks[kinds[0]] if len(kinds) == 1 else masks

    def _within_reach(self, kind: str, allowed: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor):
        """``allowed`` (B, T, K) narrowed to the keys (positions (B, K)) a query (positions (B, T)) of a ``kind``
        layer reaches, as transformers' mask functions say: sliding windows ``q - k < window``, chunks
        ``q // chunk == k // chunk`` (positions count from a row's first real token, as transformers counts them
        past a left padding); full attention reaches every key."""
        if kind == "sliding_attention" and self.window is not None:
            return allowed & ((queries[:, :, None] - keys[:, None, :]) < self.window)
        if kind == "chunked_attention" and self.chunk is not None:
            return allowed & (torch.div(queries, self.chunk, rounding_mode="floor")[:, :, None]
                              == torch.div(keys, self.chunk, rounding_mode="floor")[:, None, :])
        return allowed

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: TreeKVCache, *, valid: torch.Tensor | None = None,
                features: bool = True, logits_to_keep: int = 1) -> TargetOutput:
        """Run prompts, causally, after the cache's ``cache.length`` committed slots (every row's).

        input_ids: (B, S); ``valid``: (B, S) bool, which tokens are real (a batch of prompts left-padded to the
        longest: False on each row's padding; None = all), at positions counting a row's real tokens from the
        committed length (padding slots at that position too: no real token sees them). ``features``: False when
        the caller reads none (they are not gathered). ``logits_to_keep``: as transformers' argument, the logits
        of the last n positions (B, n, V) float, 0 = every position."""
        past, (batch, length) = cache.length, input_ids.shape
        if valid is None:
            positions = torch.arange(past, past + length)
        else:
            if tuple(valid.shape) != (batch, length):
                raise ValueError(f"valid must be (B, S) = {(batch, length)} like input_ids, got {tuple(valid.shape)}.")
            valid = valid.to(self.device)
            positions = past + (valid.long().cumsum(-1) - 1).clamp(min=0)
            if past:
                valid = torch.cat([torch.ones(batch, past, dtype=torch.bool, device=self.device), valid], dim=1)
        features = self._reads_features(features)
        outputs = self._run(input_ids, cache, positions, None, valid, None, features, logits_to_keep)
        return self._computed(outputs, features)

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, cache: TreeKVCache, positions: torch.Tensor, *,
               valid: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
               features: bool = True) -> TargetOutput:
        """Plain decoding's step: one new token per row after each row's committed slots.

        input_ids: (B, 1); positions: (B, 1) or (1,) their RoPE positions; ``valid`` (B, past + 1) and
        ``key_positions`` (B, past) as in :meth:`attention_mask`. Returns logits (B, 1, V) float and, unless
        ``features`` is False, features (B, 1, F)."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"decode takes one new token per row, (B, 1); got {tuple(input_ids.shape)}.")
        features = self._reads_features(features)
        outputs = self._run(input_ids, cache, positions, None, valid, key_positions, features, 0)
        return self._computed(outputs, features)

    @torch.no_grad()
    def verify(self, input_ids: torch.Tensor, cache: TreeKVCache, positions: torch.Tensor,
               tree_mask: torch.Tensor, *, valid: torch.Tensor | None = None,
               key_positions: torch.Tensor | None = None, features: bool = True,
               projection: LazyProjection | None = None) -> TargetOutput:
        """Tree verification: N nodes per row after each row's committed slots, each seeing its ancestors.

        input_ids: (B, N) the nodes' tokens; positions: (B, N) or (N,) their RoPE positions (committed length +
        depth); ``tree_mask`` (B, N, N) or (N, N), ``valid`` (B, past + N) and ``key_positions`` (B, past) as in
        :meth:`attention_mask`. A node that ``valid`` marks False is padding (beyond its row's tree): no real
        token sees it, and packed linear layers skip its row
        (:func:`~eagle.model.backends.linear.real_rows_only`), so its logits and features are meaningless.

        Logits: (B, N, V) float; or, given a ``projection`` and where this target allows it (a CPU, logits that
        are the LM head of the last hidden state), :class:`~eagle.model.base.logits.LazyLogits` projecting the
        rows as ``projection`` says. Features (B, N, F), or None when ``features`` is False."""
        features = self._reads_features(features)
        if projection is None or self._lazy_logits is not True:  # only ever True for a target that has features
            outputs = self._run(input_ids, cache, positions, tree_mask, valid, key_positions, features, 0)
            return self._computed(outputs, features)
        projection.check(input_ids.shape[0])
        first = projection.first
        # one row: the model's own LM head projects them; several: gathered per row (see _lazy)
        logits_to_keep = torch.tensor(first[0] if len(first) == 1 else [], dtype=torch.long, device=self.device)
        # the LM head reads chosen positions, in any order: with one row it must not take them for every token
        skip_padding = len(first) > 1
        outputs = self._run(input_ids, cache, positions, tree_mask, valid, key_positions, True, logits_to_keep,
                            skip_padding)
        return TargetOutput(logits=self._lazy(projection, outputs),
                            features=self._features(outputs) if features else None)

    def _run(self, input_ids: torch.Tensor, cache: TreeKVCache, position_ids: torch.Tensor,
             tree_mask: torch.Tensor | None, valid: torch.Tensor | None, key_positions: torch.Tensor | None,
             hidden_states: bool, logits_to_keep, skip_padding: bool = True):
        """The model call every entry point makes: the new tokens (B, T) written after the cache's
        ``cache.length`` slots, at ``position_ids`` (B, T) or (T,), under the mask :meth:`attention_mask` builds
        from ``tree_mask`` (None: causal), ``valid`` and ``key_positions``. New tokens that ``valid`` marks False
        are padding, whose rows packed linear layers skip unless ``skip_padding`` is False. Returns the model's
        output (with every layer's hidden states when ``hidden_states``)."""
        past = cache.length
        mask = self.attention_mask(past, position_ids, tree_mask, valid, key_positions)
        position_ids = position_ids.to(self.device)
        real = None if valid is None or not skip_padding else valid[:, past:].to(self.device)
        position_ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        with real_rows_only(real):
            return self.forward_plan.run(self.model, input_ids=input_ids.to(self.device), attention_mask=mask,
                                         position_ids=position_ids, cache=cache, output_hidden_states=hidden_states,
                                         logits_to_keep=logits_to_keep, query_positions=position_ids)

    def _reads_features(self, features: bool) -> bool:
        return features and self.feature_layers is not None

    def _features(self, outputs) -> torch.Tensor:
        """The hidden states of ``feature_layers`` concatenated (B, T, F)."""
        states = outputs.hidden_states
        home = states[self.feature_layers[0]].device  # layers may live on several devices
        return torch.cat([states[i].to(home) for i in self.feature_layers], dim=-1)

    def _computed(self, outputs, features: bool) -> TargetOutput:
        """The output with every kept position's logits (float) and, when asked, the features; the first such
        output with features decides whether lazy logits match the model's (see :class:`LazyLogits`)."""
        logits = outputs.logits.float()
        if self._lazy_logits is None and features:
            self._lazy_logits = self._projection_matches(outputs.hidden_states[-1][0, -logits.shape[1]:], logits[0])
        return TargetOutput(logits=logits, features=self._features(outputs) if features else None)

    def _lazy(self, projection: LazyProjection, outputs) -> LazyLogits:
        hidden = outputs.hidden_states[-1]
        first = projection.first
        pairs = [(b, i) for b, rows in enumerate(first) for i in rows]
        if len(first) == 1:
            projected = outputs.logits[0].float()
        else:
            index = torch.tensor(pairs, device=hidden.device)
            projected = self.project(hidden[index[:, 0], index[:, 1]])
        return LazyLogits(dict(zip(pairs, projected)), hidden, self.project, projection)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) last hidden states -> (n, V) float logits, through the LM head alone."""
        head = self.model.get_output_embeddings()
        return head(hidden.to(head.weight.device)).float()

    def _projection_matches(self, hidden: torch.Tensor, logits: torch.Tensor) -> bool:
        """Whether the model's logits are its LM head applied to its last hidden state (what LazyLogits assumes)."""
        projected = self.project(hidden)
        scale = float(logits.abs().max()) if logits.numel() else 0.0
        return projected.shape == logits.shape and bool(((projected - logits).abs() <= 1e-4 * scale + 1e-6).all())

