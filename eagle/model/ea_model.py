"""``EaModel``: the reference's API (a Hugging Face causal LM plus an EAGLE draft head, generating losslessly faster)
as a thin facade over :class:`~eagle.model.engine.engine.Engine`.

Every generation method checks its input into a request once and consumes the one loop's steps; the arguments of
the reference (``use_eagle``, ``is_llama3``, ``log``...) are translated here and go no further. What drafts is a
drafter spec of :mod:`eagle.model.drafting.registry` (``drafter="eagle3"``, ``"none"``, ``"eagle3+lookup"``...):
the model's default (``EaModel.drafter``, :class:`~eagle.model.drafting.choice.DrafterChoice`), or one per call
(None: the default); ``use_eagle`` is its alias (:func:`~eagle.model.drafting.registry.reference_drafter`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from eagle.model.drafting.choice import DrafterChoice
from eagle.model.drafting.registry import HEAD, NONE, reference_drafter
from eagle.model.drafting.settings import TreePlan, TreeSettings
from eagle.model.engine.greedy import GREEDY_TEMPERATURE
from eagle.model.engine.engine import ContinuousBatch, Engine
from eagle.model.engine.hf_args import check_generate_extras
from eagle.model.engine.outputs import collect, stream
from eagle.model.engine.steps import BatchStep, Step
from eagle.model.engine.stops import token_id_set
from eagle.model.backends.registry import switch_backend
from eagle.model.base.target import feature_layers


class EaModel(DrafterChoice, nn.Module):
    """A base model (``base_model``), its draft head (``ea_layer``; None: no EAGLE drafter) and tokenizer; ``engine``
    runs them. Build it with :meth:`from_pretrained`. Generation takes one sequence or a left-padded batch."""

    def __init__(self, base_model, ea_layer, tokenizer=None, total_token: int = 60, depth: int = 7, top_k: int = 10,
                 *, base_model_name_or_path: str | None = None, use_eagle3: bool | None = None, lookup_tokens: int = 0,
                 ea_model_path: str | None = None, thread_policy: bool = True,
                 allow_unknown_attention: bool = False, drafter: str | None = None):
        super().__init__()
        self.base_model, self.ea_layer, self.tokenizer, self.config = base_model, ea_layer, tokenizer, base_model.config
        self.base_model_name_or_path, self.ea_model_path = base_model_name_or_path, ea_model_path
        self.use_eagle3 = ea_layer is not None and (ea_layer.eagle_version == 3 if use_eagle3 is None else use_eagle3)
        layers = feature_layers(ea_layer, self.use_eagle3, base_model.config.get_text_config().num_hidden_layers)
        self.hidden_size, self.vocab_size = base_model.get_output_embeddings().weight.shape[::-1]
        plan = TreePlan(TreeSettings(total_token, depth, top_k, lookup_tokens))
        self.engine = Engine(base_model, ea_layer, tokenizer, plan, layers, thread_policy=thread_policy,
                             allow_unknown_attention=allow_unknown_attention, drafter=drafter)

    @classmethod
    def from_pretrained(cls, use_eagle3: bool | None = None, base_model_path: str | None = None, ea_model_path=None,
                        total_token: int | None = None, depth: int | None = None, top_k: int | None = None,
                        threshold: float = 1.0, pack_cpu_weights: bool | str = "auto", lookup_tokens: int | None = None,
                        draft_dtype="auto", thread_policy: bool = True, drafter=None, **kwargs) -> "EaModel":
        """Load a base model (a directory, a Hub id or a ``.gguf`` file) and its head (a directory or Hub id); with
        neither path, the embedded default pair. See :func:`eagle.model.pretrained.load_pretrained` for every
        argument (``drafter``: the default drafter; tree settings not given: the head's own tree for this device)."""
        from eagle.model.pretrained import load_pretrained

        return load_pretrained(cls, use_eagle3=use_eagle3, drafter=drafter, base_model_path=base_model_path,
                               ea_model_path=ea_model_path, tree={"total_token": total_token, "depth": depth,
                                                                  "top_k": top_k, "lookup_tokens": lookup_tokens},
                               threshold=threshold, pack_cpu_weights=pack_cpu_weights, draft_dtype=draft_dtype,
                               thread_policy=thread_policy, **kwargs)

    # ------------------------------------------------------------------ trees
    def set_tree(self, total_token: int, depth: int, top_k: int, lookup_tokens: int | None = None) -> None:
        """Change the draft tree (None keeps the current ``lookup_tokens``); like any tree set explicitly, it applies
        to every batch size (:meth:`set_batch_trees` sets per-batch trees again)."""
        lookup = self.tree_settings.lookup_tokens if lookup_tokens is None else lookup_tokens
        self.tree_settings = TreeSettings(total_token, depth, top_k, lookup)

    @property
    def tree_settings(self) -> TreeSettings:
        """The tree of a single sequence, and of every batch size ``batch_trees`` has no entry for. Assigning it
        empties ``batch_trees``."""
        return self.engine.plan.batch1

    @tree_settings.setter
    def tree_settings(self, settings: TreeSettings) -> None:
        self.engine.plan = TreePlan(settings)

    @property
    def batch_trees(self) -> dict[int, TreeSettings]:
        """``{smallest batch size: TreeSettings}`` (see :mod:`eagle.model.drafting.batch_tree`)."""
        return dict(self.engine.plan.by_batch)

    def set_batch_trees(self, trees: dict[int, TreeSettings]) -> None:
        """Per-batch trees: a batch of B rows drafts with the entry of the largest key <= B (re-chosen each step as
        rows finish), ``tree_settings`` below every key; ``{}``: ``tree_settings`` for every batch size."""
        self.engine.plan = TreePlan(self.tree_settings, trees)

    def tree_for_batch(self, batch_size: int) -> TreeSettings:
        """The tree a batch of ``batch_size`` rows drafts with."""
        return self.engine.plan.for_batch(batch_size)

    @property
    def total_token(self) -> int:
        return self.tree_settings.total_token

    def set_cpu_weight_packing(self, enabled: bool) -> int:
        """Pack (or unpack) the float32 CPU weights of the base model's and the head's linear layers for oneDNN
        (the ``"onednn"`` linear backend, :mod:`eagle.model.backends.linear`). Returns how many changed."""
        return switch_backend("onednn", enabled, self.base_model, self.ea_layer)

    @property
    def thread_policy(self):  # see Engine
        return self.engine.thread_policy

    @thread_policy.setter
    def thread_policy(self, policy) -> None:
        self.engine.thread_policy = policy

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def get_tokenizer(self):
        return self.tokenizer

    def stop_token_ids(self, is_llama3: bool = False) -> set[int]:
        """EOS of the tokenizer and of ``generation_config``, and ``<|eot_id|>`` where the vocabulary has it."""
        return self.engine.stop_token_ids(is_llama3)

    # ------------------------------------------------------------------ reference-compatible forward
    @torch.no_grad()
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, output_orig=False, position_ids=None):
        """Run the base model. Returns ``(outputs, hidden_states)`` or, with ``output_orig``, ``(outputs, logits,
        hidden_states)``; ``hidden_states`` is the final normed state, ``outputs.hidden_states`` all layers."""
        outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                                  position_ids=position_ids, output_hidden_states=True)
        if output_orig:
            return outputs, outputs.logits, outputs.hidden_states[-1]
        return outputs, outputs.hidden_states[-1]

    # ------------------------------------------------------------------ generation
    def _request(self, input_ids, mask=None, *, use_eagle=None, drafter=None, **kw):
        return self.engine.request(input_ids, mask, drafter=reference_drafter(drafter, use_eagle=use_eagle), **kw)

    def generate_steps(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                       is_llama3=False, use_eagle=None, generator: torch.Generator | None = None,
                       drafter: str | None = None) -> Iterator[Step]:
        """One sequence: an iterator of :class:`~eagle.model.engine.steps.RowStep`, one per target forward pass
        (checked before anything runs). For a batch, :meth:`generate_batch_steps`. ``drafter``: see the module."""
        request = self._request(input_ids, temperature=temperature, top_p=top_p, top_k=top_k, use_eagle=use_eagle,
                                max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3,
                                generator=generator, drafter=drafter)
        if request.batch_size != 1:
            raise ValueError(f"generate_steps() generates one sequence; input_ids holds {request.batch_size}. Use "
                             "generate_batch_steps() for a batch.")
        return (step.rows[0] for step in self.engine.run(request))

    def generate_batch_steps(self, input_ids, attention_mask=None, temperature=0.0, top_p=0.0, top_k=0,
                             max_new_tokens=512, max_length=2048, is_llama3=False, use_eagle=None,
                             generator: torch.Generator | None = None, stop_token_ids=None,
                             drafter: str | None = None) -> Iterator[BatchStep]:
        """A batch (what a server's scheduler drives): ``input_ids`` (B, S) left-padded with ``attention_mask``, or
        a list of 1-D prompts. One :class:`~eagle.model.engine.steps.BatchStep` per target forward pass;
        ``stop_token_ids`` replaces the model's stop tokens. Checked before anything runs."""
        return self.engine.run(self._request(
            input_ids, attention_mask, temperature=temperature, top_p=top_p, top_k=top_k, use_eagle=use_eagle,
            max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3, generator=generator,
            stop_ids=stop_token_ids, drafter=drafter))

    def continuous_batch(self, temperature=0.0, top_p=0.0, top_k=0, max_length=2048, is_llama3=False,
                         use_eagle=None, generator: torch.Generator | None = None,
                         stop_token_ids=None, drafter: str | None = None) -> ContinuousBatch:
        """A batch that prompts join and leave between steps (see :class:`~eagle.model.engine.engine.ContinuousBatch`),
        with one set of sampling settings and one drafter. The model runs one generation at a time."""
        return self.engine.open_batch(drafter=reference_drafter(drafter, use_eagle=use_eagle), temperature=temperature,
                                      top_p=top_p, top_k=top_k, max_length=max_length, is_llama3=is_llama3,
                                      generator=generator, stop_ids=stop_token_ids)

    def _reference_request(self, drafter, input_ids, attention_mask, *settings):
        names = ("temperature", "top_p", "top_k", "max_new_tokens", "max_length", "is_llama3")  # in this order
        return self._request(input_ids, attention_mask, drafter=drafter, **dict(zip(names, settings, strict=True)))

    @torch.no_grad()
    def eagenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                   log=False, is_llama3=False, attention_mask=None, drafter: str | None = None):
        """Speculative generation: ``input_ids`` (1, S) or (S,), a batch (B, S) left-padded with ``attention_mask``,
        or a list of 1-D prompts. Returns the ids (B, S + T), rows that end early filled with the pad token; with
        ``log=True``, ``(ids, new_tokens, idx)``, ``idx`` the reference's 0-based index of the last draft/verify
        cycle (plain ints for one sequence, lists of B ints for a batch). ``drafter`` None: the model's default."""
        request = self._reference_request(drafter or HEAD, input_ids, attention_mask, temperature, top_p, top_k,
                                          max_new_tokens, max_length, is_llama3)
        return collect(self.engine.run(request), request, log)

    @torch.no_grad()
    def naivegenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                      log=False, is_llama3=False, attention_mask=None):
        """Plain decoding with the same loop, for comparison. Same input and returns as :meth:`eagenerate`."""
        request = self._reference_request(NONE, input_ids, attention_mask, temperature, top_p, top_k,
                                          max_new_tokens, max_length, is_llama3)
        return collect(self.engine.run(request), request, log)

    def ea_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                    log=False, is_llama3=False, attention_mask=None, drafter: str | None = None):
        """Streaming :meth:`eagenerate`: yields the whole ids (B, S + T so far) after each step."""
        request = self._reference_request(drafter or HEAD, input_ids, attention_mask, temperature, top_p, top_k,
                                          max_new_tokens, max_length, is_llama3)
        yield from stream(self.engine.run(request), request)

    def naive_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                       log=False, is_llama3=False, attention_mask=None):
        """Streaming :meth:`naivegenerate`: yields the whole ids after each token."""
        request = self._reference_request(NONE, input_ids, attention_mask, temperature, top_p, top_k,
                                          max_new_tokens, max_length, is_llama3)
        yield from stream(self.engine.run(request), request)

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_length: int | None = None,
                 use_eagle: bool | None = None, eos_token_id: int | list[int] | None = None,
                 pad_token_id: int | None = None, drafter: str | None = None, **extras):
        """Hugging Face style: ``model.generate(**tokenizer(texts, padding=True, return_tensors="pt"),
        max_new_tokens=...)`` (left padding). Greedy unless ``do_sample``; ``eos_token_id`` replaces the stop
        tokens and ``pad_token_id`` the filler, as in Hugging Face; arguments it cannot honour raise a
        ``ValueError``. Returns ids (B, S + T)."""
        if input_ids is None:
            raise ValueError("generate() needs input_ids.")
        check_generate_extras(extras)
        if do_sample and temperature <= GREEDY_TEMPERATURE:
            raise ValueError("do_sample=True needs temperature > 0.")
        request = self._request(input_ids, attention_mask, temperature=temperature if do_sample else 0.0,
                                top_p=top_p if do_sample else 0.0, top_k=top_k if do_sample else 0,
                                max_new_tokens=max_new_tokens, max_length=max_length, use_eagle=use_eagle,
                                drafter=drafter, stop_ids=None if eos_token_id is None else token_id_set(eos_token_id),
                                pad_token_id=pad_token_id)
        return collect(self.engine.run(request), request, False)
