"""Timed generation methods shared by the answer scripts and the benchmark.

Each method runs one generation and returns a ``Generation``: the new token ids, the wall time, the number of
target forward passes and, for EAGLE, the accepted length of every draft/verify step.

How EAGLE is timed (one honest approach, used everywhere): we consume the streaming generator
``EaModel.ea_generate`` and time the whole loop, from before the call to after the last yield, synchronising
the device at both ends. ``eagenerate`` is itself a consumer of the same generator, so the streamed run does
the same work; reading ``ids.shape`` after each yield is host metadata and forces no device sync. The first
yield (prefill) adds one token; every later yield adds ``accept_length + 1`` tokens (accepted drafts, then the
target's own token), which is how the per-step accepted lengths are recorded. The last step of a turn may be
cut short by a stop token or by ``max_new_tokens``; it then counts as the length that was kept. Plain decoding
is timed the same way through ``naive_generate``; Hugging Face ``generate`` is timed around the call.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from eagle.model.loading import DTYPES_BY_NAME
from eagle.utils.device import default_device, synchronize

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


def _stream(generator, prompt_length: int, device, record_accepts: bool) -> Generation:
    synchronize(device)
    start = time.perf_counter()
    previous = prompt_length
    yields = 0
    accept_lengths: list[int] = []
    last = None
    for ids in generator:
        added = ids.shape[1] - previous
        if yields > 0 and record_accepts:
            accept_lengths.append(max(added - 1, 0))
        previous = ids.shape[1]
        last = ids
        yields += 1
    synchronize(device)
    wall_time = time.perf_counter() - start
    new_ids = [] if last is None else last[0, prompt_length:].tolist()
    return Generation(new_ids, wall_time, forward_passes=yields, accept_lengths=accept_lengths)


def eagle_generate(model, input_ids: torch.Tensor, *, temperature: float = 0.0, top_p: float = 0.0,
                   top_k: float = 0.0, max_new_tokens: int = 512, max_length: int | None = None,
                   is_llama3: bool = False) -> Generation:
    """EAGLE speculative decoding of ``input_ids`` (1, S) through ``model.ea_generate``, timed, with the
    accepted length of every step."""
    generator = model.ea_generate(
        input_ids, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
        max_length=max_length or default_max_length(input_ids.shape[1], max_new_tokens), is_llama3=is_llama3,
    )
    return _stream(generator, input_ids.shape[1], input_ids.device, record_accepts=True)


def plain_generate(model, input_ids: torch.Tensor, *, temperature: float = 0.0, top_p: float = 0.0,
                   top_k: float = 0.0, max_new_tokens: int = 512, max_length: int | None = None,
                   is_llama3: bool = False) -> Generation:
    """Plain one-token-per-step decoding with the same engine (``model.naive_generate``), timed."""
    generator = model.naive_generate(
        input_ids, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
        max_length=max_length or default_max_length(input_ids.shape[1], max_new_tokens), is_llama3=is_llama3,
    )
    return _stream(generator, input_ids.shape[1], input_ids.device, record_accepts=False)


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

    sampling = temperature > 1e-5
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
    every method counts the same tokens: the engine's own set when an ``EaModel`` is loaded, else the same rule
    (EOS of the tokenizer, the generation config and the model config, and ``<|eot_id|>`` if it exists)."""
    if ea_model is not None:
        return sorted(ea_model.stop_token_ids(is_llama3))
    ids: set[int] = set()
    generation_config = getattr(hf_model, "generation_config", None)
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None),
                  getattr(hf_model.config, "eos_token_id", None)):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item >= 0:
                ids.add(item)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    if isinstance(eot, int) and eot >= 0 and eot != getattr(tokenizer, "unk_token_id", None):
        ids.add(eot)
    return sorted(ids)


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


def resolve_model_paths(args) -> None:
    """``--base-model-path`` / ``--ea-model-path``: both given, or neither, and then the embedded default pair, with
    its tuned tree for whichever of ``args.total_token/depth/top_k/lookup_tokens`` exist and are None."""
    if args.base_model_path is None and args.ea_model_path is None:
        from eagle import defaults as embedded  # lazy: only needed for the default run

        args.base_model_path = embedded.default_base_model_path()
        args.ea_model_path = embedded.default_ea_model_path()
        for key, value in embedded.default_tree_settings().items():  # the tree tuned for the embedded pair
            if hasattr(args, key) and getattr(args, key) is None:
                setattr(args, key, value)
    elif args.base_model_path is None or args.ea_model_path is None:
        raise SystemExit("Give both --base-model-path and --ea-model-path, or neither (the embedded default pair).")


def add_device_arguments(parser) -> None:
    """``--device`` and ``--dtype`` for an evaluation CLI; :func:`resolve_device` and :func:`resolve_dtype` read them."""
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps, xpu...")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="Model dtype; auto = float16 on an accelerator, float32 on the CPU.")


def resolve_device(name: str | None) -> torch.device:
    """``"auto"``/None: the best available accelerator; otherwise ``torch.device(name)``."""
    if name in (None, "", "auto"):
        return default_device()
    try:
        return torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device {name!r} is not a device (expected auto, cpu, cuda, cuda:1, mps...).") from err


DTYPES = DTYPES_BY_NAME


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"``: float16 on an accelerator (as the reference scripts), float32 on the CPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.float16
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not supported; expected auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


def head_version_hint(ea_model_path: str | None) -> int | None:
    """3 if the head's local ``config.json`` has EAGLE-3's ``draft_vocab_size``, 1 if it has a config
    without it, None when there is no local config to read."""
    if not ea_model_path or not os.path.isdir(ea_model_path):
        return None
    path = os.path.join(ea_model_path, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return 3 if isinstance(config, dict) and "draft_vocab_size" in config else 1


def load_ea_model(base_model_path: str, ea_model_path: str, *, use_eagle3: bool, total_token: int | None = None,
                  depth: int | None = None, top_k: int | None = None, lookup_tokens: int | None = None,
                  dtype: torch.dtype = torch.float32,
                  device: torch.device | None = None, **hf_kwargs):
    """``EaModel.from_pretrained`` with the given tree settings (None = the loader's own default), on
    ``device``. Warns when the head's config looks like the other EAGLE version than ``use_eagle3`` says."""
    from eagle.model.ea_model import EaModel

    hint = head_version_hint(ea_model_path)
    wanted = 3 if use_eagle3 else 1
    if hint is not None and hint != wanted:
        logger.warning(
            "Loading %s as an EAGLE-%d head, but its config.json looks like an EAGLE-%d head%s. Pass %s if "
            "loading fails.", ea_model_path, wanted, hint,
            " (it has draft_vocab_size)" if hint == 3 else " (it has no draft_vocab_size)",
            "--use-eagle3" if hint == 3 else "--no-eagle3",
        )
    logger.info("Loading base model %s and EAGLE-%d head %s", base_model_path, wanted, ea_model_path)
    tree = {name: value for name, value in (("total_token", total_token), ("depth", depth), ("top_k", top_k),
                                            ("lookup_tokens", lookup_tokens)) if value is not None}
    device = device or torch.device("cpu")
    if device.type != "cpu" and "device_map" not in hf_kwargs:
        hf_kwargs["device_map"] = str(device)
    model = EaModel.from_pretrained(
        use_eagle3=use_eagle3, base_model_path=base_model_path, ea_model_path=ea_model_path, dtype=dtype,
        **tree, **hf_kwargs,
    )
    model.eval()
    return model


def load_hf_model(base_model_path: str, *, dtype: torch.dtype = torch.float32, device: torch.device | None = None,
                  **hf_kwargs):
    """The base model alone (a plain Hugging Face causal LM, loaded as ``EaModel`` loads it: directory, Hub id or
    ``.gguf`` file) and its tokenizer."""
    from eagle.model.loading import load_base_model

    device = device or torch.device("cpu")
    if device.type != "cpu" and "device_map" not in hf_kwargs:
        hf_kwargs["device_map"] = str(device)
    return load_base_model(base_model_path, dtype=dtype, **hf_kwargs)


def model_device(model) -> torch.device:
    """Where a model's inputs go: ``model.device`` if it has one, else its first parameter's device."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device
