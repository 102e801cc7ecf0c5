"""``EaModel``: a Hugging Face causal LM plus an EAGLE draft head, generating losslessly faster.

The four reference generation methods (``eagenerate``, ``naivegenerate``, ``ea_generate``, ``naive_generate``)
and the Hugging Face style ``generate`` are thin wrappers over one loop, :func:`generation.speculative_decode_batch`:
each checks its input into a frozen :class:`~eagle.model.request.GenerationRequest` (one sequence or a left-padded
batch) and consumes the loop's steps. ``generate_steps`` (one sequence) and ``generate_batch_steps`` (a batch: per
row new tokens, accepted drafts and a finished flag after every target forward pass, for a server's scheduler)
expose the steps themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from .cpu_linear import pack_linear_layers, should_auto_pack, unpack_linear_layers
from .draft_config import head_layer_ids
from .drafter import EagleDrafter, NoDrafter, TreeSettings
from .batch_tree import check_batch_trees, describe_batch_trees, head_batch_trees, largest_tree_size, tree_for_batch
from .generation import BatchStep, RunningBatch, Step, speculative_decode_batch
from .head_tree import check_tree_arguments, head_tree_for, resolve_tree
from .kv_cache import check_cache_fits
from .loading import load_base_model, load_ea_layer
from .request import GenerationRequest, build_request
from .target import Target, eagle3_layer_ids
from ..utils.openmp import release_openmp_threads
from ..utils.threads import ThreadPolicy

logger = logging.getLogger(__name__)


# Hugging Face ``generate`` arguments that change nothing here: dropped silently.
_HARMLESS_GENERATE_ARGS = {"token_type_ids", "bos_token_id", "use_cache"}
# Arguments honoured only at their neutral value (a different one would be silently ignored otherwise).
_NEUTRAL_GENERATE_ARGS = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "min_new_tokens": 0,
                          "return_dict_in_generate": False, "output_scores": False, "output_logits": False,
                          "output_attentions": False, "output_hidden_states": False}


def _check_generate_extras(extras: dict) -> None:
    """Refuse ``generate`` arguments that would be silently ignored, saying what is supported instead."""
    refused = sorted(
        name for name, value in extras.items()
        if name not in _HARMLESS_GENERATE_ARGS and value is not None
        and not (name in _NEUTRAL_GENERATE_ARGS and value == _NEUTRAL_GENERATE_ARGS[name])
    )
    if refused:
        raise ValueError(
            f"EaModel.generate() cannot honour {', '.join(refused)}. It supports input_ids, attention_mask (left "
            "padding), max_new_tokens, max_length, do_sample, temperature, top_p, top_k, eos_token_id and use_eagle; "
            "for streaming use ea_generate(), for anything else the base model's own generate() (model.base_model)."
        )


def _model_paths(base_model_path, ea_model_path, kwargs: dict) -> tuple[str, str]:
    """The two paths ``from_pretrained`` loads: as given (``eagle_model_path`` in ``kwargs`` is another name for
    ``ea_model_path``), or the embedded default pair when neither is given."""
    if "eagle_model_path" in kwargs:
        alias = kwargs.pop("eagle_model_path")
        if ea_model_path is not None and ea_model_path != alias:
            raise ValueError("Pass the draft head path once: ea_model_path and eagle_model_path differ.")
        ea_model_path = alias
    if base_model_path is None and ea_model_path is None:
        from eagle.defaults import default_base_model_path, default_ea_model_path

        base_model_path, ea_model_path = default_base_model_path(), default_ea_model_path()
        logger.info("No model given: the embedded default pair (%s, %s)", base_model_path, ea_model_path)
    elif base_model_path is None or ea_model_path is None:
        raise ValueError("EaModel.from_pretrained needs both base_model_path and ea_model_path, or neither (the "
                         "embedded default pair, SmolLM2-135M-Instruct with this project's head).")
    return base_model_path, ea_model_path


def _describe(tree: TreeSettings) -> str:
    return (f"total_token={tree.total_token} depth={tree.depth} top_k={tree.top_k} "
            f"lookup_tokens={tree.lookup_tokens}")


def _token_id_set(value) -> set[int]:
    """One token id or a collection of them (int, list, tuple, set, tensor) as a set of ints."""
    if isinstance(value, (set, frozenset)):
        value = list(value)
    return {int(i) for i in torch.as_tensor(value).flatten().tolist()}


class EaModel(nn.Module):
    """A base model (``base_model``), its draft head (``ea_layer``) and tokenizer (``tokenizer``).

    Build it with :meth:`from_pretrained`. Generation takes one sequence or a left-padded batch.
    """

    def __init__(self, base_model, ea_layer, tokenizer=None, total_token: int = 60, depth: int = 7, top_k: int = 10,
                 *, base_model_name_or_path: str | None = None, use_eagle3: bool | None = None, lookup_tokens: int = 0,
                 ea_model_path: str | None = None, thread_policy: bool = True):
        super().__init__()
        self.base_model = base_model
        self.ea_layer = ea_layer
        self.tokenizer = tokenizer
        self.config = base_model.config
        self.base_model_name_or_path = base_model_name_or_path
        self.ea_model_path = ea_model_path
        self.use_eagle3 = ea_layer.eagle_version == 3 if use_eagle3 is None else use_eagle3
        self.hidden_size = base_model.get_output_embeddings().weight.shape[-1]
        self.vocab_size = base_model.get_output_embeddings().weight.shape[0]
        num_layers = base_model.config.get_text_config().num_hidden_layers
        if self.use_eagle3:
            layer_ids = head_layer_ids(ea_layer.config) or eagle3_layer_ids(num_layers)
        else:
            layer_ids = [-1]  # EAGLE-1 reads the final normed hidden state
        self._eagle_target = Target(base_model, feature_layers=list(layer_ids))
        self._plain_target = Target(base_model, feature_layers=None)
        self._cache = None
        self.set_tree(total_token, depth, top_k, lookup_tokens)
        self.batch_trees: dict[int, TreeSettings] = {}
        cpu = self.device.type == "cpu"  # elsewhere the CPU threads do not carry the step
        self.thread_policy = ThreadPolicy() if thread_policy and cpu else None  # see eagle.utils.threads

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, use_eagle3: bool = True, base_model_path: str | None = None, ea_model_path: str | None = None,
                        total_token: int | None = None, depth: int | None = None, top_k: int | None = None,
                        threshold: float = 1.0, pack_cpu_weights: bool | str = "auto", lookup_tokens: int | None = None,
                        draft_dtype="auto", thread_policy: bool = True, **kwargs):
        """Load the base model (a local directory, a Hub id, or a ``.gguf`` file / directory holding one) and the
        head (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``). With neither path, the embedded
        default pair (SmolLM2-135M-Instruct and this project's head, see :mod:`eagle.defaults`): nothing is
        downloaded. ``eagle_model_path`` is accepted as another name for ``ea_model_path``. Other keyword arguments
        go to the base model's ``from_pretrained`` (``dtype``/``torch_dtype``, ``device_map``...).

        Tree settings (``total_token`` nodes verified per step, root included; ``depth``; ``top_k``;
        ``lookup_tokens``): each one not given (None) comes from the tree the head carries for this kind of device
        (the ``eagle_tree`` field of its ``config.json``, see :mod:`eagle.model.head_tree`), else from the
        reference's defaults 60/7/10 and no lookup. ``total_token=-1`` tunes the whole tree on this device (the
        settings given explicitly stay fixed; see :mod:`eagle.model.autotune`), once per device, base model and
        head: the result is cached. ``lookup_tokens``: graft up to this many tokens copied from earlier in the
        context onto each draft tree (prompt lookup, see :mod:`eagle.model.lookup`); 0 drafts with the head
        alone, as the reference. ``threshold`` is the reference's argument, accepted and unused (as there).

        ``pack_cpu_weights``: pack the linear layers' float32 CPU weights into oneDNN's layout (see
        :mod:`eagle.model.cpu_linear`; it makes verifying a draft tree much cheaper on a CPU, and costs a second copy
        of those weights in memory). ``"auto"`` (default) packs float32 CPU models whose linear weights take at most
        2 GiB; ``True`` packs whatever can be packed; ``False`` leaves the layers alone.

        ``draft_dtype``: the dtype of the draft head. ``"auto"`` (default) runs the EAGLE-3 head of a float32 model
        in bfloat16 on a CPU that computes in bfloat16 natively (AVX512-BF16 or AMX), where a draft pass reads half
        the bytes, and in the base model's dtype elsewhere; a torch dtype (or "float32", "bfloat16", "float16")
        forces one. The output does not depend on it: the target verifies every token.

        ``thread_policy``: True (default) lets the generation loop choose torch's thread count as the machine is
        now (fewer threads when other programs take CPUs; see :mod:`eagle.utils.threads`); it stays out whenever
        the user set the count (``OMP_NUM_THREADS``, ``torch.set_num_threads``). False leaves the count alone, as
        does a model off the CPU. The output does not depend on it."""
        del threshold  # the reference's EAGLE-2 drafting never reads it either
        if pack_cpu_weights not in (True, False, "auto"):
            raise ValueError(f"pack_cpu_weights must be True, False or 'auto', not {pack_cpu_weights!r}.")
        if not isinstance(thread_policy, bool):
            raise ValueError(f"thread_policy must be True or False, not {thread_policy!r}.")
        check_tree_arguments(total_token, depth, top_k, lookup_tokens)  # invalid settings fail before loading
        base_model_path, ea_model_path = _model_paths(base_model_path, ea_model_path, kwargs)
        base_model, tokenizer = load_base_model(base_model_path, **kwargs)
        ea_layer = load_ea_layer(ea_model_path, base_model, use_eagle3, draft_dtype=draft_dtype)
        explicit = {"total_token": total_token, "depth": depth, "top_k": top_k, "lookup_tokens": lookup_tokens}
        device = base_model.get_input_embeddings().weight.device
        tree, sources = resolve_tree(explicit, head_tree_for(ea_layer.config, device))
        model = cls(base_model, ea_layer, tokenizer, tree.total_token, tree.depth, tree.top_k,
                    base_model_name_or_path=base_model_path, use_eagle3=use_eagle3, lookup_tokens=tree.lookup_tokens,
                    ea_model_path=ea_model_path, thread_policy=thread_policy)
        if pack_cpu_weights is True or (pack_cpu_weights == "auto" and should_auto_pack(base_model)):
            logger.info("Packed the CPU weights of %d linear layers for oneDNN (pack_cpu_weights=%r)",
                        model.set_cpu_weight_packing(True), pack_cpu_weights)
        if total_token == -1:
            from .autotune import tune_tree

            fixed = {key: value for key, value in explicit.items() if value is not None and key != "total_token"}
            model.tree_settings = tune_tree(model, fixed=fixed)
        else:
            logger.info("Tree %s (%s)", _describe(model.tree_settings),
                        ", ".join(f"{key} from the {source}" if source != "argument" else f"{key} given"
                                  for key, source in sources.items()))
        if all(value is None for value in explicit.values()):  # an explicit tree applies to every batch size
            model.set_batch_trees(head_batch_trees(ea_layer.config, device, model.tree_settings))
        release_openmp_threads()  # generation may run on another thread (a server's worker): see utils.openmp
        return model

    def set_tree(self, total_token: int, depth: int, top_k: int, lookup_tokens: int | None = None) -> None:
        """Change the draft tree settings (nodes verified per step including the root, depth, top-k, and the most
        prompt-lookup tokens grafted per step; None keeps the current value). ``tree_settings`` holds them: the
        one place the drafter reads. Like any tree set explicitly, it applies to batches too (``batch_trees`` is
        emptied; :meth:`set_batch_trees` sets per-batch trees again)."""
        if lookup_tokens is None:
            lookup_tokens = self.tree_settings.lookup_tokens if hasattr(self, "tree_settings") else 0
        self.tree_settings = TreeSettings(total_token=total_token, depth=depth, top_k=top_k,
                                          lookup_tokens=lookup_tokens)

    @property
    def tree_settings(self) -> TreeSettings:
        """The draft tree of a single sequence, and of every batch size ``batch_trees`` has no entry for.
        Assigning it empties ``batch_trees`` (an explicit tree applies to every batch size)."""
        return self._tree_settings

    @tree_settings.setter
    def tree_settings(self, settings: TreeSettings) -> None:
        self._tree_settings = settings
        self.batch_trees = {}

    def set_batch_trees(self, trees: dict[int, TreeSettings]) -> None:
        """Per-batch trees: ``{smallest batch size (>= 2): TreeSettings}``; a batch of B rows drafts with the entry
        of the largest key <= B (re-chosen each step as rows finish), ``tree_settings`` below every key. ``{}``:
        ``tree_settings`` for every batch size. See :mod:`eagle.model.batch_tree`; the embedded head carries
        the CPU's."""
        self.batch_trees = check_batch_trees(trees)
        if self.batch_trees:
            logger.info("Batch trees: %s", describe_batch_trees(self.batch_trees))

    def _eagle_drafter(self) -> EagleDrafter:
        if not self.batch_trees:  # the one-tree signature (a drafter class replaced for a test takes only that)
            return EagleDrafter(self.ea_layer, self.tree_settings)
        return EagleDrafter(self.ea_layer, self.tree_settings, self.batch_trees)

    def tree_for_batch(self, batch_size: int) -> TreeSettings:
        """The tree a batch of ``batch_size`` rows drafts with."""
        return tree_for_batch(self.tree_settings, self.batch_trees, batch_size)

    def set_cpu_weight_packing(self, enabled: bool) -> int:
        """Pack (or unpack) the float32 CPU weights (and a bfloat16 head's, where the CPU computes in bfloat16
        natively) of the base model's and the head's linear layers in place (see
        :mod:`eagle.model.cpu_linear`); the base model's own ``generate`` uses them too. Returns how many layers
        changed. Outputs agree with unpacked layers to float32 rounding."""
        change = pack_linear_layers if enabled else unpack_linear_layers
        count = change(self.base_model) + change(self.ea_layer)
        logger.debug("%s %d linear layers", "Packed the CPU weights of" if enabled else "Unpacked", count)
        return count

    @property
    def total_token(self) -> int:
        return self.tree_settings.total_token

    @property
    def device(self) -> torch.device:
        return self.base_model.get_input_embeddings().weight.device

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ reference-compatible forward
    @torch.no_grad()
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, output_orig=False, position_ids=None):
        """Run the base model. Returns ``(outputs, hidden_states)`` or, with ``output_orig``, ``(outputs, logits,
        hidden_states)``; ``hidden_states`` is the final normed state, ``outputs.hidden_states`` all layers."""
        outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past_key_values,
                                  position_ids=position_ids, output_hidden_states=True)
        hidden = outputs.hidden_states[-1]
        if output_orig:
            return outputs, outputs.logits, hidden
        return outputs, hidden

    # ------------------------------------------------------------------ generation
    def stop_token_ids(self, is_llama3: bool = False) -> set[int]:
        """EOS of the tokenizer and of ``generation_config``, and ``<|eot_id|>`` where the vocabulary has it."""
        ids: set[int] = set()
        generation_eos = getattr(getattr(self.base_model, "generation_config", None), "eos_token_id", None)
        for value in (generation_eos, getattr(self.tokenizer, "eos_token_id", None), getattr(self.config, "eos_token_id", None)):
            if value is None:
                continue
            ids.update(_token_id_set(value))
        if self.tokenizer is not None:
            eot = self.tokenizer.convert_tokens_to_ids("<|eot_id|>")
            unk = getattr(self.tokenizer, "unk_token_id", None)
            if isinstance(eot, int) and eot != unk and eot >= 0:
                ids.add(eot)
            elif is_llama3:
                raise ValueError("is_llama3=True but the tokenizer has no <|eot_id|> token.")
        return ids

    def _pad_token_id(self, stop_ids) -> int:
        """The id that fills a batch's rows after they end: the tokenizer's pad token, else the generation config's,
        else an end-of-sequence token (as Hugging Face ``generate`` does)."""
        for value in (getattr(self.tokenizer, "pad_token_id", None),
                      getattr(getattr(self.base_model, "generation_config", None), "pad_token_id", None),
                      getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int) and 0 <= value < self.vocab_size:
                return value
        return min(stop_ids) if stop_ids else 0

    def _request(self, input_ids, attention_mask=None, *, temperature=0.0, top_p=0.0, top_k=0, max_new_tokens=512,
                 max_length: int | None = 2048, is_llama3=False, use_eagle=True, generator=None, stop_ids=None,
                 pad_token_id: int | None = None) -> GenerationRequest:
        """Check a call's input and settings (``ValueError``/``TypeError`` before anything runs) into a frozen
        :class:`~eagle.model.request.GenerationRequest`."""
        stop_ids = self.stop_token_ids(is_llama3) if stop_ids is None else stop_ids
        if pad_token_id is None:
            pad_token_id = self._pad_token_id(stop_ids)
        return build_request(input_ids, attention_mask, vocab_size=self.vocab_size, device=self.device,
                             temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                             max_length=max_length, use_eagle=use_eagle, stop_token_ids=stop_ids,
                             pad_token_id=pad_token_id, generator=generator)

    def _cache_for(self, request: GenerationRequest):
        """The preallocated cache for ``request``'s rows: the longest padded prompt plus the largest budget plus
        one tree. Refuses (``ValueError``) a batch whose cache would not fit in the free memory."""
        tree_size = largest_tree_size(self.tree_settings, self.batch_trees, request.batch_size)
        capacity = request.input_ids.shape[1] + max(request.budgets) + tree_size
        return self._reserve_cache(request.batch_size, capacity, fresh=True)

    def _reserve_cache(self, batch_size: int, capacity: int, fresh: bool):
        """The shared cache, with room for ``batch_size`` rows of ``capacity`` slots (checked against the free
        memory first). ``fresh``: a generation starts, a cache too small is replaced; else (rows join a running
        batch) it grows in place, keeping its rows."""
        config, dtype = self.config.get_text_config(), self.base_model.dtype
        cache = self._cache
        if cache is None or cache.capacity < capacity:
            check_cache_fits(config, batch_size, capacity, dtype, self.device)
            if cache is None or fresh:
                self._cache = None  # free the old one first
                self._cache = self._eagle_target.new_cache(capacity)  # grown for this call; reused by later ones
            else:
                cache.grow(capacity)
        elif cache.batch_size != batch_size:  # reallocated for this batch size when first written
            check_cache_fits(config, batch_size, cache.capacity, dtype, self.device)
        return self._cache

    def _steps(self, request: GenerationRequest) -> Iterator[BatchStep]:
        """The generation loop over a checked request: one :class:`~eagle.model.generation.BatchStep` per target
        forward pass."""
        if request.use_eagle:
            target, drafter = self._eagle_target, self._eagle_drafter()
        else:
            target, drafter = self._plain_target, NoDrafter()
        return speculative_decode_batch(target, drafter, self._cache_for(request), request.engine_ids,
                                        list(request.pads), request.sampler(), list(request.budgets),
                                        set(request.stop_token_ids), self.thread_policy)

    def generate_steps(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                       is_llama3=False, use_eagle=True, generator: torch.Generator | None = None) -> Iterator[Step]:
        """The generation loop for one sequence: an iterator of :class:`~eagle.model.generation.Step`, one per
        target forward pass. The request is checked here, before anything runs. For a batch, see
        :meth:`generate_batch_steps`."""
        request = self._request(input_ids, temperature=temperature, top_p=top_p, top_k=top_k,
                                max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3,
                                use_eagle=use_eagle, generator=generator)
        if request.batch_size != 1:
            raise ValueError(f"generate_steps() generates one sequence; input_ids holds {request.batch_size}. Use "
                             "generate_batch_steps() for a batch.")
        return (Step(tokens=step.tokens[0], accepted=step.accepted[0]) for step in self._steps(request))

    def generate_batch_steps(self, input_ids, attention_mask=None, temperature=0.0, top_p=0.0, top_k=0,
                             max_new_tokens=512, max_length=2048, is_llama3=False, use_eagle=True,
                             generator: torch.Generator | None = None,
                             stop_token_ids=None) -> Iterator[BatchStep]:
        """The generation loop for a batch (what a server's scheduler drives): ``input_ids`` (B, S) left-padded
        with ``attention_mask``, or a list of 1-D prompts. Yields one :class:`~eagle.model.generation.BatchStep`
        per target forward pass: for each of the B rows its new tokens, accepted drafts and whether it has
        finished. ``stop_token_ids`` replaces the model's stop tokens. Checked before anything runs."""
        stop_ids = None if stop_token_ids is None else _token_id_set(stop_token_ids)
        return self._steps(self._request(input_ids, attention_mask, temperature=temperature, top_p=top_p,
                                         top_k=top_k, max_new_tokens=max_new_tokens, max_length=max_length,
                                         is_llama3=is_llama3, use_eagle=use_eagle, generator=generator,
                                         stop_ids=stop_ids))

    def continuous_batch(self, temperature=0.0, top_p=0.0, top_k=0, max_length=2048, is_llama3=False,
                         use_eagle=True, generator: torch.Generator | None = None,
                         stop_token_ids=None) -> "ContinuousBatch":
        """A batch that prompts join and leave between steps (what a server's scheduler drives; see
        :class:`ContinuousBatch`), with one set of sampling settings. The model runs one generation at a time:
        no other generation call while it runs."""
        stop_ids = self.stop_token_ids(is_llama3) if stop_token_ids is None else _token_id_set(stop_token_ids)
        return ContinuousBatch(self, dict(temperature=temperature, top_p=top_p, top_k=top_k, max_length=max_length,
                                          use_eagle=use_eagle, generator=generator, stop_ids=stop_ids))

    def _stream_ids(self, request: GenerationRequest):
        new: list[list[int]] = [[] for _ in range(request.batch_size)]
        for step in self._steps(request):
            for row, tokens in enumerate(step.tokens):
                new[row] += tokens.tolist()
            yield request.output_ids(new)

    def _run(self, request: GenerationRequest, log: bool):
        new: list[list[int]] = [[] for _ in range(request.batch_size)]
        cycles = [-1] * request.batch_size  # the prefill's step is not a draft/verify cycle
        for step in self._steps(request):
            for row, tokens in enumerate(step.tokens):
                if tokens.numel():
                    new[row] += tokens.tolist()
                    cycles[row] += 1
        ids = request.output_ids(new)
        if not log:
            return ids
        # the reference's idx: the 0-based index of the last draft/verify cycle
        counts, idx = [len(tokens) for tokens in new], [max(c - 1, 0) for c in cycles]
        return (ids, counts[0], idx[0]) if request.batch_size == 1 else (ids, counts, idx)

    def _call(self, use_eagle, input_ids, attention_mask, temperature, top_p, top_k, max_new_tokens, max_length,
              is_llama3) -> GenerationRequest:
        return self._request(input_ids, attention_mask, temperature=temperature, top_p=top_p, top_k=top_k,
                             max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3,
                             use_eagle=use_eagle)

    @torch.no_grad()
    def eagenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                   log=False, is_llama3=False, attention_mask=None):
        """Speculative generation. ``input_ids``: (1, S) or (S,); a batch (B, S) left-padded with
        ``attention_mask``; or a list of 1-D prompts of different lengths. Returns the ids (B, S + T), rows that end
        early filled with the pad token on the right. With ``log=True``, ``(ids, new_tokens, idx)``: the new tokens
        and the reference's ``idx``, the 0-based index of the last draft/verify cycle (cycles - 1, so
        ``new_tokens / (idx + 1)`` is tokens per cycle); plain ints for one sequence, lists of B ints for a
        batch."""
        return self._run(self._call(True, input_ids, attention_mask, temperature, top_p, top_k, max_new_tokens,
                                    max_length, is_llama3), log)

    @torch.no_grad()
    def naivegenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                      log=False, is_llama3=False, attention_mask=None):
        """Plain decoding with the same loop, for comparison. Same input and returns as :meth:`eagenerate`."""
        return self._run(self._call(False, input_ids, attention_mask, temperature, top_p, top_k, max_new_tokens,
                                    max_length, is_llama3), log)

    def ea_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                    log=False, is_llama3=False, attention_mask=None):
        """Streaming :meth:`eagenerate`: yields the whole ids (B, S + T so far) after each step, every row's tokens
        so far (rows behind the longest filled with the pad token)."""
        yield from self._stream_ids(self._call(True, input_ids, attention_mask, temperature, top_p, top_k,
                                               max_new_tokens, max_length, is_llama3))

    def naive_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                       log=False, is_llama3=False, attention_mask=None):
        """Streaming :meth:`naivegenerate`: yields the whole ids after each token."""
        yield from self._stream_ids(self._call(False, input_ids, attention_mask, temperature, top_p, top_k,
                                               max_new_tokens, max_length, is_llama3))

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_length: int | None = None,
                 use_eagle: bool = True, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 **extras):
        """Hugging Face style: ``model.generate(**tokenizer(texts, padding=True, return_tensors="pt"),
        max_new_tokens=...)`` (left padding: ``tokenizer.padding_side = "left"``). Greedy unless ``do_sample``;
        ``top_p=1`` and ``top_k=0`` mean off; ``eos_token_id`` replaces the model's stop tokens and
        ``pad_token_id`` the filler of rows that end early, as in Hugging Face. Arguments it cannot honour (beam
        search, repetition penalty...) raise a ``ValueError``. Returns ids (B, S + T)."""
        if input_ids is None:
            raise ValueError("generate() needs input_ids.")
        _check_generate_extras(extras)
        if do_sample and temperature <= 1e-5:
            raise ValueError("do_sample=True needs temperature > 0.")
        stop_ids = None if eos_token_id is None else _token_id_set(eos_token_id)
        request = self._request(input_ids, attention_mask, temperature=temperature if do_sample else 0.0,
                                top_p=top_p if do_sample else 0.0, top_k=top_k if do_sample else 0,
                                max_new_tokens=max_new_tokens, max_length=max_length, use_eagle=use_eagle,
                                stop_ids=stop_ids, pad_token_id=pad_token_id)
        return self._run(request, False)


class ContinuousBatch:
    """A running batch of ``EaModel`` (:meth:`EaModel.continuous_batch`): the engine's
    :class:`~eagle.model.generation.RunningBatch` with each prompt checked as every generation method checks it.

    - ``add(input_ids, attention_mask=None, max_new_tokens=512) -> list[int]``: one prompt (S,) or (1, S), a
      left-padded batch or a list of prompts, each with its own budget; returns their row numbers. Checked at
      once (``ValueError``; the cache grows if it must, refused when it would not fit in memory); the rows join at
      the next step boundary (prefilled together, then verified with the others).
    - ``cancel(row)``: the row leaves at the next step boundary (a client that went away).
    - Iterating yields, after each target forward pass, a dict {row: :class:`~eagle.model.generation.RowStep`}
      (new tokens, accepted drafts, finished). Each row's greedy tokens are those of its prompt alone; sampled rows
      follow the target distribution. Iteration ends when no row generates or waits; ``close()`` abandons it.
    """

    def __init__(self, model: EaModel, settings: dict):
        self.model, self.settings = model, settings
        self._running = None
        self._capacity = 0

    def add(self, input_ids, attention_mask=None, max_new_tokens: int = 512) -> list[int]:
        settings = dict(self.settings)
        use_eagle = settings.pop("use_eagle")
        request = self.model._request(input_ids, attention_mask, max_new_tokens=max_new_tokens, use_eagle=use_eagle,
                                      **settings)
        rows = request.batch_size + (self._running.size if self._running is not None else 0)
        tree = largest_tree_size(self.model.tree_settings, self.model.batch_trees, rows) if use_eagle else 1
        self._capacity = max(self._capacity, request.input_ids.shape[1] + max(request.budgets) + tree)
        cache = self.model._reserve_cache(rows, self._capacity, fresh=self._running is None)
        if self._running is None:
            target, drafter = ((self.model._eagle_target, self.model._eagle_drafter())
                               if use_eagle else (self.model._plain_target, NoDrafter()))
            self._running = RunningBatch(target, drafter, cache, request.sampler(), set(request.stop_token_ids),
                                         self.model.thread_policy)
        return self._running.add(request.engine_ids, list(request.pads), list(request.budgets))

    def cancel(self, row: int) -> None:
        if self._running is not None:
            self._running.cancel(row)

    @property
    def size(self) -> int:
        """Rows generating or waiting to join."""
        return 0 if self._running is None else self._running.size

    def __iter__(self) -> Iterator[dict]:
        return iter(self._running) if self._running is not None else iter(())

    def close(self) -> None:
        if self._running is not None:
            self._running.close()
