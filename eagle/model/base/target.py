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
from eagle.model.base.families import check_attention_known
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


class LazyLogits:
    """Logits after each of T new positions of B rows, each (row, position) projected through the LM head when
    first read.

    On a CPU the LM head (hidden x vocabulary, e.g. 576 x 49,152) costs as much as several layers for every row of
    a draft tree, and verification reads only the rows on the accepted path: projecting those alone saves most of
    that cost.

    Reading the LM head's weights dominates a projection, so a few rows cost little more than one (timings:
    docs/PERFORMANCE.md). The rows read first are therefore projected in the verification forward pass
    (``first_rows``: verification passes each tree's root and its likeliest descendants), and ``rows_with(b, i)``, when given, names the positions of batch row
    ``b`` to project together with a position ``i`` read later (``i`` first): verification passes the node's
    likeliest descendants, which it reads next whenever the node is accepted, so a long accepted path costs one or
    two projections instead of one per token, and a short one none. :meth:`fetch` projects what several batch rows
    read next in one call.

    ``logits[i]`` reads position ``i`` of batch row 0; ``logits.row(b)[i]`` of row ``b``.
    """

    def __init__(self, first_rows: dict[tuple[int, int], torch.Tensor], last_hidden: torch.Tensor, project,
                 rows_with=None):
        self._rows = dict(first_rows)
        self._hidden = last_hidden  # (B, T, H)
        self._project = project
        self.rows_with = rows_with

    def fetch(self, wanted: list[tuple[int, int]]) -> None:
        """Project, in one call, the (batch row, position) pairs not projected yet, each with ``rows_with``'s."""
        todo: list[tuple[int, int]] = []
        for batch_row, index in wanted:
            if (batch_row, index) in self._rows:
                continue
            more = [index] if self.rows_with is None else self.rows_with(batch_row, index)
            todo += [(batch_row, i) for i in more if (batch_row, i) not in self._rows and (batch_row, i) not in todo]
        if todo:
            rows, positions = zip(*todo)
            device = self._hidden.device
            projected = self._project(self._hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)])
            self._rows.update(zip(todo, projected))

    def get(self, batch_row: int, index) -> torch.Tensor:
        key = (batch_row, int(index))
        if key not in self._rows:
            self.fetch([key])
        return self._rows[key]

    def row(self, batch_row: int) -> "_LazyRow":
        return _LazyRow(self, batch_row)

    def __getitem__(self, index) -> torch.Tensor:
        return self.get(0, index)


class _LazyRow:
    """One batch row of :class:`LazyLogits`, indexable by position."""

    def __init__(self, logits: LazyLogits, batch_row: int):
        self.logits, self.batch_row = logits, batch_row

    def __getitem__(self, index) -> torch.Tensor:
        return self.logits.get(self.batch_row, index)


@dataclass
class TargetOutput:
    logits: torch.Tensor | LazyLogits  # (B, T', V) float: every position, or only the last one for a prefill
    features: torch.Tensor | None  # (B, T, F) hidden states EAGLE reads, or None when not asked for


class Target:
    """Runs the target model over new tokens at given positions, on top of a :class:`TreeKVCache`.

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
        self.slot_bytes()  # measured now, so that the first generation's memory check runs nothing

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
        """Bytes one row's cache holds per slot, over all layers: measured once, when the target is built, from
        what the model writes for one token (MLA models cache a compressed latent, not heads x head_dim keys and
        values)."""
        if self._slot_bytes is None:
            cache = self.new_cache(1)
            self.forward(torch.zeros(1, 1, dtype=torch.long), cache, torch.zeros(1, dtype=torch.long), features=False)
            self._slot_bytes = cache.slot_bytes()
        return self._slot_bytes

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
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: TreeKVCache,
        position_ids: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        last_logits_only: bool = False,
        lazy_logits: bool = False,
        first_rows: list[int] | list[list[int]] | None = None,
        valid: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        features: bool = True,
    ) -> TargetOutput:
        """input_ids: (B, T) new tokens, written to the cache after its ``cache.length`` slots; position_ids:
        (B, T) or (T,) their RoPE positions (tree depth + prefix length for a tree); ``tree_mask``, ``valid`` and
        ``key_positions`` as in :meth:`attention_mask`. A new token that ``valid`` marks False is padding (a tree
        node beyond its row's tree, a left-padded prompt slot): no real token sees it, and packed linear layers skip
        its row (:func:`~eagle.model.backends.linear.real_rows_only`), so its logits and features are meaningless.

        ``lazy_logits``: the caller reads only some rows (tree verification); when this target allows it, the
        logits come back as :class:`LazyLogits`, with the positions ``first_rows`` (one list per batch row, or one
        list for a single row; default: position 0; position 0 first) projected in this forward pass and the
        others when read. ``features``: False when the caller reads no features (plain decoding): none are
        gathered."""
        past = cache.length
        features = features and self.feature_layers is not None
        lazy = lazy_logits and self._lazy_logits is True  # only ever True for a target that returns features
        if lazy:
            first_rows = _first_rows(first_rows, input_ids.shape[0])
            # one row: the model's own LM head projects them; several: gathered per row below
            logits_to_keep = torch.tensor(first_rows[0] if len(first_rows) == 1 else [], dtype=torch.long,
                                          device=self.device)
        else:
            logits_to_keep = 1 if last_logits_only else 0
        mask = self.attention_mask(past, position_ids, tree_mask, valid, key_positions)
        position_ids = position_ids.to(self.device)
        real = None if valid is None else valid[:, past:].to(self.device)  # (B, T): which new tokens are real
        if lazy and len(first_rows) == 1:
            real = None  # the LM head reads chosen positions, in any order: it must not take them for every token
        position_ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        with real_rows_only(real):
            outputs = self.forward_plan.run(self.model, input_ids=input_ids.to(self.device), attention_mask=mask,
                                            position_ids=position_ids, cache=cache,
                                            output_hidden_states=features or lazy, logits_to_keep=logits_to_keep,
                                            query_positions=position_ids)
        gathered = None
        if features:
            states = outputs.hidden_states
            home = states[self.feature_layers[0]].device  # layers may live on several devices
            gathered = torch.cat([states[i].to(home) for i in self.feature_layers], dim=-1)
        if lazy:
            return TargetOutput(logits=self._lazy(first_rows, outputs), features=gathered)
        logits = outputs.logits.float()
        if self._lazy_logits is None and features:
            self._lazy_logits = self._projection_matches(outputs.hidden_states[-1][0, -logits.shape[1]:], logits[0])
        return TargetOutput(logits=logits, features=gathered)

    def _lazy(self, first_rows: list[list[int]], outputs) -> LazyLogits:
        hidden = outputs.hidden_states[-1]
        pairs = [(b, i) for b, rows in enumerate(first_rows) for i in rows]
        if len(first_rows) == 1:
            projected = outputs.logits[0].float()
        else:
            index = torch.tensor(pairs, device=hidden.device)
            projected = self.project(hidden[index[:, 0], index[:, 1]])
        return LazyLogits(dict(zip(pairs, projected)), hidden, self.project)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) last hidden states -> (n, V) float logits, through the LM head alone."""
        head = self.model.get_output_embeddings()
        return head(hidden.to(head.weight.device)).float()

    def _projection_matches(self, hidden: torch.Tensor, logits: torch.Tensor) -> bool:
        """Whether the model's logits are its LM head applied to its last hidden state (what LazyLogits assumes)."""
        projected = self.project(hidden)
        scale = float(logits.abs().max()) if logits.numel() else 0.0
        return projected.shape == logits.shape and bool(((projected - logits).abs() <= 1e-4 * scale + 1e-6).all())


def _first_rows(first_rows, batch: int) -> list[list[int]]:
    """``first_rows`` as one list of positions per batch row, each starting with position 0."""
    if first_rows is None:
        first_rows = [[0]] * batch
    elif first_rows and not isinstance(first_rows[0], (list, tuple)):
        first_rows = [list(first_rows)]
    if len(first_rows) != batch or any(not rows or rows[0] != 0 for rows in first_rows):
        raise ValueError(f"first_rows must give, for each of the {batch} rows, positions starting with 0; got "
                         f"{first_rows}.")
    return [list(rows) for rows in first_rows]
