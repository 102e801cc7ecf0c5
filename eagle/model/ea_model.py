"""``EaModel``: a Hugging Face causal LM plus an EAGLE draft head, generating losslessly faster.

The four reference generation methods (``eagenerate``, ``naivegenerate``, ``ea_generate``, ``naive_generate``)
and the Hugging Face style ``generate`` are thin wrappers over one loop, :func:`generation.speculative_decode`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from .cpu_linear import pack_linear_layers, should_auto_pack, unpack_linear_layers
from .draft_config import head_layer_ids
from .drafter import EagleDrafter, NoDrafter, TreeSettings
from .generation import Step, speculative_decode
from .head_tree import check_tree_arguments, head_tree_for, resolve_tree
from .loading import load_base_model, load_ea_layer
from .target import Target, eagle3_layer_ids
from .verify import Sampler

logger = logging.getLogger(__name__)


# Hugging Face ``generate`` arguments that change nothing here: dropped silently.
_HARMLESS_GENERATE_ARGS = {"token_type_ids", "pad_token_id", "bos_token_id", "use_cache"}
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
            f"EaModel.generate() cannot honour {', '.join(refused)}. It supports input_ids, attention_mask (no "
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

    Build it with :meth:`from_pretrained`. Generation works on one sequence at a time.
    """

    def __init__(self, base_model, ea_layer, tokenizer=None, total_token: int = 60, depth: int = 7, top_k: int = 10,
                 *, base_model_name_or_path: str | None = None, use_eagle3: bool | None = None, lookup_tokens: int = 0,
                 ea_model_path: str | None = None):
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

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, use_eagle3: bool = True, base_model_path: str | None = None, ea_model_path: str | None = None,
                        total_token: int | None = None, depth: int | None = None, top_k: int | None = None,
                        threshold: float = 1.0, pack_cpu_weights: bool | str = "auto", lookup_tokens: int | None = None,
                        draft_dtype="auto", **kwargs):
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
        forces one. The output does not depend on it: the target verifies every token."""
        del threshold  # the reference's EAGLE-2 drafting never reads it either
        if pack_cpu_weights not in (True, False, "auto"):
            raise ValueError(f"pack_cpu_weights must be True, False or 'auto', not {pack_cpu_weights!r}.")
        check_tree_arguments(total_token, depth, top_k, lookup_tokens)  # invalid settings fail before loading
        base_model_path, ea_model_path = _model_paths(base_model_path, ea_model_path, kwargs)
        base_model, tokenizer = load_base_model(base_model_path, **kwargs)
        ea_layer = load_ea_layer(ea_model_path, base_model, use_eagle3, draft_dtype=draft_dtype)
        explicit = {"total_token": total_token, "depth": depth, "top_k": top_k, "lookup_tokens": lookup_tokens}
        device = base_model.get_input_embeddings().weight.device
        tree, sources = resolve_tree(explicit, head_tree_for(ea_layer.config, device))
        model = cls(base_model, ea_layer, tokenizer, tree.total_token, tree.depth, tree.top_k,
                    base_model_name_or_path=base_model_path, use_eagle3=use_eagle3, lookup_tokens=tree.lookup_tokens,
                    ea_model_path=ea_model_path)
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
        return model

    def set_tree(self, total_token: int, depth: int, top_k: int, lookup_tokens: int | None = None) -> None:
        """Change the draft tree settings (nodes verified per step including the root, depth, top-k, and the most
        prompt-lookup tokens grafted per step; None keeps the current value). ``tree_settings`` holds them: the
        one place the drafter reads."""
        if lookup_tokens is None:
            lookup_tokens = self.tree_settings.lookup_tokens if hasattr(self, "tree_settings") else 0
        self.tree_settings = TreeSettings(total_token=total_token, depth=depth, top_k=top_k,
                                          lookup_tokens=lookup_tokens)

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

    def _check_request(self, input_ids, temperature, top_p, top_k, max_new_tokens, max_length) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.LongTensor of shape (1, seq_len), got {type(input_ids).__name__}.")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (1, seq_len), got {tuple(input_ids.shape)}.")
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"input_ids holds a batch of {input_ids.shape[0]} sequences; EaModel generates one sequence at a time "
                "(shape (1, seq_len))."
            )
        if input_ids.shape[1] == 0:
            raise ValueError("The prompt is empty: input_ids must contain at least one token.")
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"input_ids contains token id {low if low < 0 else high}, outside the vocabulary [0, {self.vocab_size}).")
        if input_ids.shape[1] >= max_length:
            raise ValueError(
                f"The prompt has {input_ids.shape[1]} tokens, which does not fit max_length={max_length} (prompt plus "
                "new tokens); shorten the prompt or raise max_length."
            )
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 or 1 = off), got {top_p}.")
        if top_k < 0 or int(top_k) != top_k:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {top_k}.")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
        return input_ids.long().to(self.device)

    def _cache_for(self, max_length: int):
        capacity = max_length + self.tree_settings.max_tree_size
        if self._cache is None or self._cache.capacity < capacity:
            self._cache = self._eagle_target.new_cache(capacity)  # grown for this call; reused by later ones
        return self._cache

    def generate_steps(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                       is_llama3=False, use_eagle=True, generator: torch.Generator | None = None) -> Iterator[Step]:
        """The generation loop: an iterator of :class:`~eagle.model.generation.Step`, one per target forward pass.
        The request is checked here, before anything runs."""
        return self._start(input_ids, temperature, top_p, top_k, max_new_tokens, max_length, is_llama3, use_eagle,
                           generator)[1]

    def _start(self, input_ids, temperature, top_p, top_k, max_new_tokens, max_length, is_llama3, use_eagle,
               generator=None, stop_ids: set[int] | None = None):
        prompt = self._check_request(input_ids, temperature, top_p, top_k, max_new_tokens, max_length)
        sampler = Sampler(temperature, top_p, int(top_k), generator) if temperature > 1e-5 else None
        if use_eagle:
            target, drafter = self._eagle_target, EagleDrafter(self.ea_layer, self.tree_settings)
        else:
            target, drafter = self._plain_target, NoDrafter()
        steps = speculative_decode(target, drafter, self._cache_for(max_length), prompt, sampler, max_new_tokens,
                                   max_length, self.stop_token_ids(is_llama3) if stop_ids is None else stop_ids)
        return prompt, steps

    def _stream_ids(self, input_ids, use_eagle, temperature, top_p, top_k, max_new_tokens, max_length, is_llama3):
        ids, steps = self._start(input_ids, temperature, top_p, top_k, max_new_tokens, max_length, is_llama3, use_eagle)
        for step in steps:
            ids = torch.cat([ids, step.tokens[None].to(ids.device)], dim=1)
            yield ids

    def _run(self, input_ids, use_eagle, log, temperature, top_p, top_k, max_new_tokens, max_length, is_llama3=False,
             stop_ids: set[int] | None = None):
        prompt, steps = self._start(input_ids, temperature, top_p, top_k, max_new_tokens, max_length, is_llama3,
                                    use_eagle, stop_ids=stop_ids)
        pieces = [step.tokens.to(prompt.device) for step in steps]
        new = torch.cat(pieces) if pieces else prompt.new_zeros(0)
        ids = torch.cat([prompt, new[None]], dim=1)
        if log:
            return ids, int(new.numel()), max(len(pieces) - 1, 0)
        return ids

    @torch.no_grad()
    def eagenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                   log=False, is_llama3=False):
        """Speculative generation. Returns the ids (1, S + n); with ``log=True``, ``(ids, new_tokens, steps)`` where
        ``steps`` is the number of draft/verify cycles (``new_tokens / (steps + 1)`` = tokens per target forward)."""
        return self._run(input_ids, True, log, temperature=temperature, top_p=top_p, top_k=top_k,
                         max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3)

    @torch.no_grad()
    def naivegenerate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                      log=False, is_llama3=False):
        """Plain decoding with the same loop, for comparison. Same returns as :meth:`eagenerate`."""
        return self._run(input_ids, False, log, temperature=temperature, top_p=top_p, top_k=top_k,
                         max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3)

    def ea_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                    log=False, is_llama3=False):
        """Streaming :meth:`eagenerate`: yields the whole ids (1, S + n so far) after each step."""
        yield from self._stream_ids(input_ids, True, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3)

    def naive_generate(self, input_ids, temperature=0.0, top_p=0.0, top_k=0.0, max_new_tokens=512, max_length=2048,
                       log=False, is_llama3=False):
        """Streaming :meth:`naivegenerate`: yields the whole ids after each token."""
        yield from self._stream_ids(input_ids, False, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max_new_tokens, max_length=max_length, is_llama3=is_llama3)

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_length: int | None = None,
                 use_eagle: bool = True, eos_token_id: int | list[int] | None = None, **extras):
        """Hugging Face style: ``model.generate(**tokenizer(text, return_tensors="pt"), max_new_tokens=...)``.
        Greedy unless ``do_sample``; ``top_p=1`` and ``top_k=0`` mean off; ``eos_token_id`` replaces the model's
        stop tokens, as in Hugging Face. Arguments it cannot honour (beam search, repetition penalty...) raise a
        ``ValueError``. Returns ids (1, S + n)."""
        if input_ids is None:
            raise ValueError("generate() needs input_ids.")
        if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
            raise ValueError("attention_mask contains padding; EaModel generates one unpadded sequence at a time.")
        _check_generate_extras(extras)
        if max_length is None:
            max_length = input_ids.shape[-1] + max_new_tokens + 1
        if do_sample and temperature <= 1e-5:
            raise ValueError("do_sample=True needs temperature > 0.")
        kwargs = dict(temperature=temperature if do_sample else 0.0, top_p=top_p if do_sample else 0.0,
                      top_k=top_k if do_sample else 0, max_new_tokens=max_new_tokens, max_length=max_length)
        stop_ids = None if eos_token_id is None else _token_id_set(eos_token_id)
        return self._run(input_ids, use_eagle, False, stop_ids=stop_ids, **kwargs)
