"""Timed generation methods shared by the answer scripts and the benchmark.

Each method runs one generation and returns a ``Generation``: the new token ids, the wall time, the number of
target forward passes and, for EAGLE, the accepted length of every draft/verify step.

How EAGLE is timed (one honest approach, used everywhere): we consume the generation loop's steps
(``EaModel.generate_steps``, which ``eagenerate`` consumes too, so the timed run does the same work) and time the
whole loop, from before the call to after the last step, synchronising the device at both ends. Each step is a
``Step(tokens, accepted)``: the prefill's one token, then for every draft/verify step its accepted drafts and the
target's own token, which is how the per-step accepted lengths are recorded. The last step of a turn may be cut
short by a stop token or by ``max_new_tokens``; it then counts the tokens kept minus one. Plain decoding is timed
the same way (drafter ``"none"``); Hugging Face ``generate`` is timed around the call.

What the benchmark can run is one list of :class:`Method` records, :data:`BENCHMARK_METHODS`, each naming its runner
(this engine, Hugging Face ``generate``, llama.cpp) and, for the engine, its drafter spec: :func:`method_named`
also takes any drafter spec of :mod:`eagle.model.drafting.registry` as a method of the engine (``none``,
``lookup``, ``eagle3``, ``eagle3+lookup``..., whatever is registered).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from eagle.model.drafting.registry import HEAD, NONE, UnknownDrafter, canonical, known_drafters, spec_head_version
from eagle.model.engine.greedy import GREEDY_TEMPERATURE
from eagle.utils.device import synchronize

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One timed generation.

    - ``new_ids``: generated token ids (prompt excluded), ending at the first stop token if one was produced;
    - ``wall_time``: seconds, device synchronised before and after;
    - ``forward_passes``: target forward passes (prefill included), None when unknown;
    - ``accept_lengths``: accepted draft tokens of each draft/verify step (EAGLE only, else empty).
    """

    new_ids: list[int]
    wall_time: float
    forward_passes: int | None = None
    accept_lengths: list[int] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return len(self.new_ids)

    @property
    def steps(self) -> int:
        """Draft/verify cycles (EAGLE) or decoding steps after the first token: forward passes minus prefill,
        so ``new_tokens / (steps + 1)`` is the number of tokens per target forward pass."""
        if self.forward_passes is None:
            return max(self.new_tokens - 1, 0)
        return max(self.forward_passes - 1, 0)


def _stream(steps, device) -> Generation:
    """Consume the loop's :class:`~eagle.model.engine.loop.Step` objects, timed: the new ids, one forward pass per
    step, and the accepted drafts of every step after the prefill (of a last step cut short, those kept before
    the cut: its tokens minus one)."""
    synchronize(device)
    start = time.perf_counter()
    pieces: list[torch.Tensor] = []
    accept_lengths: list[int] = []
    for step in steps:
        if pieces:
            accept_lengths.append(min(step.accepted, step.tokens.numel() - 1))
        pieces.append(step.tokens)
    synchronize(device)
    wall_time = time.perf_counter() - start
    new_ids = torch.cat(pieces).tolist() if pieces else []
    return Generation(new_ids, wall_time, forward_passes=len(pieces), accept_lengths=accept_lengths)


def engine_generate(model, input_ids: torch.Tensor, *, drafter: str, temperature: float = 0.0, top_p: float = 0.0,
                    top_k: float = 0.0, max_new_tokens: int = 512, max_length: int | None = None,
                    is_llama3: bool = False) -> Generation:
    """Generation of ``input_ids`` (1, S) through ``model.generate_steps`` with ``drafter`` (a drafter spec, or
    ``"head"``: the head's own), timed, with the accepted length of every step (none for ``"none"``)."""
    steps = model.generate_steps(
        input_ids, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
        max_length=max_length or default_max_length(input_ids.shape[1], max_new_tokens), is_llama3=is_llama3,
        drafter=drafter,
    )
    generation = _stream(steps, input_ids.device)
    if drafter == NONE:
        generation.accept_lengths = []
    return generation


def eagle_generate(model, input_ids: torch.Tensor, **options) -> Generation:
    """EAGLE speculative decoding (the head's own drafter) of ``input_ids`` (1, S), timed; see
    :func:`engine_generate` for the options."""
    return engine_generate(model, input_ids, drafter=HEAD, **options)


def plain_generate(model, input_ids: torch.Tensor, **options) -> Generation:
    """Plain one-token-per-step decoding with the same engine and loop (drafter ``"none"``), timed."""
    return engine_generate(model, input_ids, drafter=NONE, **options)


# ------------------------------------------------------------------------------------------- the benchmark's methods
ENGINE, HF_GENERATE, LLAMACPP = "engine", "hf_generate", "llama.cpp"


@dataclass(frozen=True)
class Method:
    """One method the benchmark can time. ``runner``: :data:`ENGINE` (this engine's loop, with ``drafter``: a
    drafter spec, ``"head"`` for the head's own; ``numerics``: on a model of its own with the GGUF kernels in
    these activations, None: the command's model; ``lookup=False``: the head's tree without its lookup branch),
    :data:`HF_GENERATE` (Hugging Face ``generate``; ``prompt_lookup``: its prompt-lookup decoding; ``unpacked``:
    with the CPU weight packing turned off) or :data:`LLAMACPP` (llama-server; ``uses_head``: with our head).
    ``default``: in the benchmark's default ``--methods``."""

    name: str
    runner: str
    label: str
    drafter: str | None = None
    numerics: str | None = None
    lookup: bool = True
    prompt_lookup: bool = False
    unpacked: bool = False
    uses_head: bool = False
    default: bool = False

    @property
    def needs_head(self) -> bool:
        """Whether it drafts with the model's EAGLE head (the benchmark then loads one)."""
        if self.runner != ENGINE:
            return self.uses_head
        return self.drafter == HEAD or spec_head_version(self.drafter) is not None

    @property
    def drafts(self) -> bool:
        """Whether its steps accept drafts (the engine with a drafter other than ``"none"``)."""
        return self.runner == ENGINE and self.drafter != NONE


def _engine(name: str, label: str, drafter: str, **settings) -> Method:
    return Method(name, ENGINE, label, drafter=drafter, **settings)


def _hf(name: str, label: str, **settings) -> Method:
    return Method(name, HF_GENERATE, label, **settings)


#: Every named method, in the order of the default ``--methods`` and of the reports.
BENCHMARK_METHODS: tuple[Method, ...] = (
    _engine("eagle", "EAGLE (eagenerate)", HEAD, default=True),
    _engine("plain", "plain decoding (naivegenerate)", NONE, default=True),
    _hf("hf_generate", "HF generate", default=True),
    _hf("prompt_lookup", "HF prompt lookup", prompt_lookup=True, default=True),
    Method("llamacpp", LLAMACPP, "llama.cpp plain (llama-server)", default=True),
    Method("llamacpp_eagle3", LLAMACPP, "llama.cpp + our EAGLE-3 head", uses_head=True, default=True),
    _hf("hf_generate_unpacked", "HF generate, unpacked weights", unpacked=True),
    _hf("prompt_lookup_unpacked", "HF prompt lookup, unpacked weights", prompt_lookup=True, unpacked=True),
    _engine("eagle_no_lookup", "EAGLE, head's tree alone (no lookup branch)", HEAD, lookup=False),
    _engine("eagle_gguf", "EAGLE, GGUF kernels (float32 activations)", HEAD, numerics="float32"),
    _engine("plain_gguf", "plain decoding, GGUF kernels (float32 activations)", NONE, numerics="float32"),
    _engine("eagle_gguf_int8", "EAGLE, GGUF kernels (int8 activations)", HEAD, numerics="int8"),
    _engine("plain_gguf_int8", "plain decoding, GGUF kernels (int8 activations)", NONE, numerics="int8"),
)
_BY_NAME = {method.name: method for method in BENCHMARK_METHODS}


def method_named(name: str) -> Method:
    """The method called ``name``: a record of :data:`BENCHMARK_METHODS`, else a drafter spec of the registry run
    on this engine with the command's model (``"eagle3+lookup"``); ``ValueError`` listing both otherwise."""
    if name in _BY_NAME:
        return _BY_NAME[name]
    try:
        spec = canonical(name)
    except UnknownDrafter as err:
        raise ValueError(f"unknown method {name!r} ({err.problem}): expected one of "
                         f"{', '.join(_BY_NAME)}, or a drafter on this engine ({known_drafters()}).") from None
    return _engine(name, f"engine, drafter {spec}", spec)


# Every GenerationConfig field that changes which token is chosen, at the value that changes nothing. ``generate``
# fills each field left None from the checkpoint's own generation_config (a repetition_penalty, a
# no_repeat_ngram_size, suppressed tokens...), so these are written explicitly; the fields whose neutral value *is*
# None (bad_words_ids, sequence_bias, forced_bos/eos_token_id, stop_strings, min_p...), and min_length (0; set beside
# min_new_tokens it draws a warning), are kept out by
# :func:`hf_generate`, which runs with the checkpoint's generation_config set aside.
NEUTRAL_DECODING = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "diversity_penalty": 0.0,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "min_new_tokens": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "guidance_scale": 1.0, "renormalize_logits": False, "remove_invalid_values": False,
    "length_penalty": 1.0, "suppress_tokens": None, "begin_suppress_tokens": None, "bad_words_ids": None,
    "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "stop_strings": None,
    "exponential_decay_length_penalty": None, "min_p": None, "top_h": None, "penalty_alpha": None,
    "dola_layers": None, "watermarking_config": None, "max_time": None, "use_cache": True,
}


def hf_generation_config(*, max_new_tokens: int, stop_ids: list[int], temperature: float = 0.0,
                         top_p: float = 0.0, prompt_lookup_num_tokens: int | None = None):
    """A complete, neutral ``GenerationConfig``: the same decoding as ``EaModel`` (greedy, or temperature with
    top-p only when asked and top-k off), with every other field that changes decoding at its neutral value
    (:data:`NEUTRAL_DECODING`), so no checkpoint default changes the baseline. Pass it to :func:`hf_generate`."""
    from transformers import GenerationConfig

    sampling = temperature > GREEDY_TEMPERATURE
    if sampling:
        options = {"temperature": temperature, "top_k": 0, "top_p": top_p if 0 < top_p < 1 else 1.0}
    else:  # transformers' neutral values, so greedy runs do not warn about the checkpoint's sampling settings
        options = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampling,
        eos_token_id=list(stop_ids) or None,
        pad_token_id=stop_ids[0] if stop_ids else None,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        **options,
    )
    for name, value in NEUTRAL_DECODING.items():
        setattr(config, name, value)
    return config


@contextmanager
def checkpoint_generation_defaults_off(hf_model):
    """While inside, ``hf_model.generation_config`` is an empty ``GenerationConfig``: ``generate`` fills the fields
    a config leaves None from transformers' neutral global defaults instead of the checkpoint's."""
    from transformers import GenerationConfig

    saved = hf_model.generation_config
    hf_model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = saved


def engine_stop_ids(tokenizer, hf_model, ea_model=None, is_llama3: bool = False) -> list[int]:
    """The ids at which ``EaModel``'s generation stops, so Hugging Face ``generate`` stops at the same ones and
    every method counts the same tokens: :func:`eagle.model.engine.stops.stop_token_ids`, the one rule, applied to
    ``ea_model`` or, when only the base model is loaded, to ``hf_model`` and ``tokenizer``."""
    from eagle.model.engine.stops import stop_token_ids

    if ea_model is not None:
        return sorted(ea_model.stop_token_ids(is_llama3))
    return sorted(stop_token_ids(hf_model, tokenizer, is_llama3))


def hf_generate(hf_model, input_ids: torch.Tensor, generation_config, stop_ids: list[int]) -> Generation:
    """Hugging Face ``generate`` (plain, or prompt lookup when the config says so), timed; forward passes
    are counted with a hook on the model, so tokens per forward pass is known for prompt lookup too. The
    checkpoint's own generation_config is set aside for the call (see :data:`NEUTRAL_DECODING`)."""
    calls = [0]

    def count(_module, _args, _output):
        calls[0] += 1

    handle = hf_model.register_forward_hook(count)
    try:
        device = input_ids.device
        synchronize(device)
        start = time.perf_counter()
        with checkpoint_generation_defaults_off(hf_model):
            output = hf_model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
            )
        synchronize(device)
        wall_time = time.perf_counter() - start
    finally:
        handle.remove()
    new_ids = output[0, input_ids.shape[1]:].tolist()
    stops = set(stop_ids)
    for position, token_id in enumerate(new_ids):
        if token_id in stops:
            new_ids = new_ids[: position + 1]
            break
    return Generation(new_ids, wall_time, forward_passes=calls[0])


def default_max_length(prompt_length: int, max_new_tokens: int) -> int:
    """A ``max_length`` (prompt + new tokens) that never cuts an answer before ``max_new_tokens``; at least 2048
    so that the engine's cache, sized by it, is not regrown for every longer prompt."""
    return max(2048, prompt_length + max_new_tokens + 1)


def model_device(model) -> torch.device:
    """Where a model's inputs go: ``model.device`` if it has one, else its first parameter's device."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device
