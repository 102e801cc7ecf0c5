"""The model flags every command line shares, and the model they load: one front door for ``python -m eagle``, the
web UI, the benchmark, the simulator, the answer scripts and any server.

In a command::

    parser = argparse.ArgumentParser(...)
    add_model_arguments(parser)           # model paths, head version, tree, device/dtype, packing, quantisation
    args = parser.parse_args()
    model = load_model_from_args(args)    # an EaModel

Without argparse (a server, a notebook)::

    model = load_model(ModelOptions(base_model_path="...", ea_model_path="...", device="auto", dtype="auto"))

:func:`add_model_arguments` takes keywords that leave out groups a command does not use (``tree=False``,
``placement=False``, ``quantization=False``) or give it its own defaults (``use_eagle3``, ``tree={"depth": 5}``,
``required_paths``). The flags (old spellings kept as aliases):

- ``--base-model-path`` (``--base-model``), ``--ea-model-path`` (``--eagle-model``);
- ``--use-eagle3`` / ``--no-eagle3`` (also ``--use_eagle3`` / ``--no_eagle3``);
- ``--drafter`` (a drafter spec of :mod:`eagle.model.drafting.registry`: what drafts by default, ``EaModel.drafter``;
  not given: the head's own; ``--drafter eagle1`` loads the head as EAGLE-1 whatever ``--use-eagle3`` says);
- ``--total-token`` (-1: timed on this device), ``--depth``, ``--top-k``, ``--lookup-tokens`` (0 = off);
- ``--device`` (auto = the best accelerator), ``--dtype`` and ``--draft-dtype`` (auto, q8_0, q4_0 or a name of
  :data:`eagle.model.heads.loading.DTYPES_BY_NAME`), ``--pack-cpu-weights`` (auto, on, off), ``--gguf-kernels``
  (auto = int8, float32, off: a GGUF base model on the CPU computed over its quantized blocks, see
  :mod:`eagle.model.backends.gguf`);
- ``--load-in-8bit`` / ``--load-in-4bit`` (bitsandbytes, CUDA only).

The rules live here and nowhere else: a model path not given is the embedded pair's
(:func:`eagle.defaults.resolve_model_paths`), and tree settings not given are left to ``EaModel.from_pretrained``,
which takes the tree the head carries for the kind of device the model runs on (the embedded head's CPU tree on a
CPU); tree values are checked when the flags are parsed; ``dtype="auto"`` is float16 on an accelerator and float32 on the CPU; where generation stops is
``EaModel.stop_token_ids``; prompts come from :mod:`eagle.templates`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass

import torch

from eagle.model.backends.gguf import GGUF_FLAG_VALUES, add_gguf_kernels_argument
from eagle.model.backends.linear import BitsAndBytesLinear
from eagle.model.backends.onednn import PACK_FLAG_VALUES, add_pack_cpu_weights_argument
from eagle.model.heads.loading import DTYPES_BY_NAME

logger = logging.getLogger(__name__)

TREE_KEYS = ("total_token", "depth", "top_k", "lookup_tokens")


@dataclass(frozen=True)
class ModelOptions:
    """What to load and where. ``None`` paths: the embedded pair's (see :func:`eagle.defaults.resolve_model_paths`);
    ``None`` tree settings: ``EaModel.from_pretrained``'s, the head's own tree for the device it runs on, else the
    reference's defaults.

    ``device``: None leaves placement to ``from_pretrained`` (the CPU); "auto" is the best accelerator; else a
    device name. ``dtype``: None is ``from_pretrained``'s default; "auto" float16 on an accelerator, float32 on the
    CPU; else a name or a ``torch.dtype``. ``quantization``: None, "8bit" or "4bit". ``need_head``: False for a
    baseline that may run without a head (then a head path not given stays None).
    """

    base_model_path: str | None = None
    ea_model_path: str | None = None
    use_eagle3: bool = True
    drafter: str | None = None
    total_token: int | None = None
    depth: int | None = None
    top_k: int | None = None
    lookup_tokens: int | None = None
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    draft_dtype: str | torch.dtype = "auto"
    pack_cpu_weights: bool | str = "auto"
    gguf_kernels: bool | str = "auto"
    quantization: str | None = None
    need_head: bool = True

    @property
    def tree(self) -> dict:
        """The tree settings that are set, as ``from_pretrained`` keyword arguments."""
        return {key: getattr(self, key) for key in TREE_KEYS if getattr(self, key) is not None}

    def resolved(self) -> ModelOptions:
        """These options with the embedded pair filled in where paths are not given (tree settings stay as
        given: see :func:`eagle.defaults.resolve_model_paths`)."""
        from eagle import defaults

        base, head = defaults.resolve_model_paths(self.base_model_path, self.ea_model_path, self.need_head)
        return dataclasses.replace(self, base_model_path=base, ea_model_path=head)


# ------------------------------------------------------------------------------------------------------ the flags
class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says it ("default: ...")."""

    def _get_help_string(self, action):
        if action.required or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _int_flag(check, expected: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ({expected}), got {text!r}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
        return value

    return parse


TREE_FLAGS = {
    "total_token": ("--total-token", _int_flag(lambda v: v > 0 or v == -1, "a positive tree size or -1 (auto)"),
                    "draft tree nodes verified per step, root included; -1 = tune the whole tree on this device "
                    "(size, depth, top-k, lookup; cached)"),
    "depth": ("--depth", _int_flag(lambda v: v >= 0, ">= 0"), "draft tree depth"),
    "top_k": ("--top-k", _int_flag(lambda v: v > 0, "a positive top-k"), "draft top-k per expanded node"),
    "lookup_tokens": ("--lookup-tokens", _int_flag(lambda v: v >= 0, ">= 0 (0 = off)"),
                      "at most this many tokens copied from earlier in the context (prompt lookup) are grafted onto "
                      "each draft tree; 0 = the head alone"),
}
LOADER_DEFAULTS = {"total_token": 60, "depth": 7, "top_k": 10, "lookup_tokens": 0}


def drafter_flag(text: str) -> str:
    """``--drafter``'s value in its one spelling; an argparse error listing the known drafters for an unknown one
    (whether the loaded model can run it is checked when it loads)."""
    from eagle.model.drafting.registry import canonical

    try:
        return canonical(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_drafter_argument(parser: argparse.ArgumentParser) -> None:
    """``--drafter NAME``: the model's default drafter (``EaModel.drafter``)."""
    from eagle.model.drafting.registry import known_drafters

    parser.add_argument("--drafter", type=drafter_flag, default=None, metavar="NAME",
                        help=f"what drafts: a drafter of the registry, {known_drafters()}; none is plain decoding "
                        "(default: the head's own, none without a head)")


def add_model_arguments(parser: argparse.ArgumentParser, *, use_eagle3: bool = True, tree: bool | dict = True,
                        placement: bool = True, quantization: bool = True,
                        required_paths: tuple[str, ...] = (), drafter: bool = True) -> None:
    """Add the model flags (see the module docstring) to ``parser``.

    ``use_eagle3``: the head version when no flag says; ``tree``: False leaves the tree flags out, a dict gives
    some of them other defaults than None; ``placement``: ``--device``/``--dtype``/``--draft-dtype``;
    ``quantization``: ``--load-in-8bit``/``--load-in-4bit``; ``required_paths``: "base" and/or "head" when the
    command has no embedded default for them; ``drafter``: False leaves ``--drafter`` out (a command that names
    its drafters otherwise). ``--pack-cpu-weights`` and ``--gguf-kernels`` are always there."""
    embedded = " (default: the embedded {})"
    parser.add_argument("--base-model-path", "--base-model", dest="base_model_path", default=None,
                        required="base" in required_paths,
                        help="base model: a directory, Hub id or .gguf file"
                        + ("" if "base" in required_paths else embedded.format("SmolLM2-135M-Instruct")))
    parser.add_argument("--ea-model-path", "--eagle-model", dest="ea_model_path", default=None,
                        required="head" in required_paths,
                        help="EAGLE draft head: a directory or Hub id"
                        + ("" if "head" in required_paths else embedded.format("EAGLE-3 head")))
    version = "EAGLE-3" if use_eagle3 else "EAGLE-1/2"
    parser.add_argument("--use-eagle3", "--use_eagle3", dest="use_eagle3", action="store_true", default=use_eagle3,
                        help=f"the head is an EAGLE-3 head (default: {version} for this command)")
    parser.add_argument("--no-eagle3", "--no_eagle3", dest="use_eagle3", action="store_false",
                        help=f"the head is an EAGLE-1/EAGLE-2 head (default: {version} for this command)")
    if drafter:
        add_drafter_argument(parser)
    if tree is not False:
        given = tree if isinstance(tree, dict) else {}
        for key, (flag, kind, text) in TREE_FLAGS.items():
            default = given.get(key)
            unset = ("the head's own tree for this device, else " if default is None else "")
            parser.add_argument(flag, type=kind, default=default,
                                help=f"{text} (default: {unset}{LOADER_DEFAULTS[key] if default is None else default})")
    if placement:
        add_placement_arguments(parser)
    add_pack_cpu_weights_argument(parser)
    add_gguf_kernels_argument(parser)
    if quantization:
        group = parser.add_mutually_exclusive_group()
        for bits in ("8", "4"):
            group.add_argument(f"--load-in-{bits}bit", action="store_true",
                               help=f"quantise the base model to {bits} bits (needs CUDA and bitsandbytes)")


def add_placement_arguments(parser: argparse.ArgumentParser, draft_dtype: bool = True) -> None:
    """``--device``, ``--dtype`` and (with ``draft_dtype``) ``--draft-dtype``."""
    parser.add_argument("--device", default="auto", help="auto (the best accelerator), cpu, cuda, cuda:1, mps, xpu...")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES_BY_NAME],
                        help="weights dtype; auto = float16 on an accelerator, float32 on the CPU")
    if draft_dtype:
        parser.add_argument("--draft-dtype", default="auto", choices=["auto", "q8_0", "q4_0", *DTYPES_BY_NAME],
                            help="draft head dtype; q8_0 (q4_0) = its linear layers over Q8_0 (Q4_0) blocks with int8 "
                            "activations on eagle's CPU kernels; auto = q8_0 for an EAGLE-3 head when the base model "
                            "runs on the GGUF kernels, else bfloat16 for the EAGLE-3 head of a float32 model on a CPU "
                            "with native bfloat16 (AVX512-BF16/AMX), else the model dtype")


def model_options(args: argparse.Namespace, need_head: bool = True) -> ModelOptions:
    """The :class:`ModelOptions` the parsed flags describe (before the embedded-pair rule is applied); flags a
    command does not have take the loader's defaults."""
    quantization = next((bits for bits in ("8bit", "4bit") if getattr(args, f"load_in_{bits}", False)), None)
    return ModelOptions(
        base_model_path=args.base_model_path, ea_model_path=args.ea_model_path,
        use_eagle3=getattr(args, "use_eagle3", True), drafter=getattr(args, "drafter", None),
        **{key: getattr(args, key, None) for key in TREE_KEYS},
        device=getattr(args, "device", None), dtype=getattr(args, "dtype", None),
        draft_dtype=getattr(args, "draft_dtype", "auto"),
        pack_cpu_weights=PACK_FLAG_VALUES[getattr(args, "pack_cpu_weights", "auto")],
        gguf_kernels=GGUF_FLAG_VALUES[getattr(args, "gguf_kernels", "auto")],
        quantization=quantization, need_head=need_head,
    )


def resolve_model_args(args: argparse.Namespace, need_head: bool = True) -> ModelOptions:
    """:func:`model_options` with the embedded pair filled in, the paths also written back to ``args`` so that a
    report records what was loaded (the tree in use is the loaded model's ``tree_settings``: tree flags not given
    stay None here). A missing embedded model exits with why."""
    try:
        options = model_options(args, need_head).resolved()
    except FileNotFoundError as err:
        raise SystemExit(f"error: {err}") from None
    args.base_model_path, args.ea_model_path = options.base_model_path, options.ea_model_path
    return options


def load_model_from_args(args: argparse.Namespace, need_head: bool = True, **hf_kwargs):
    """The ``EaModel`` the flags describe (:func:`model_options`, then :func:`load_model`; ``args`` are left as
    parsed: call :func:`resolve_model_args` first to record the paths that were used; ``need_head`` False with no
    head path: the base model alone). A model that cannot be loaded (missing files, a head that does not fit the
    base model) exits with the reason."""
    try:
        return load_model(model_options(args, need_head), **hf_kwargs)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: could not load the model: {err}") from err


# --------------------------------------------------------------------------------------------------- the loading
def resolve_device(name) -> torch.device:
    """``"auto"``/None: the best available accelerator; otherwise ``torch.device(name)``."""
    from eagle.utils.device import default_device

    if isinstance(name, torch.device):
        return name
    if name in (None, "", "auto"):
        return default_device()
    try:
        return torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device {name!r} is not a device (expected auto, cpu, cuda, cuda:1, mps...).") from err


def resolve_dtype(name, device: torch.device) -> torch.dtype:
    """``"auto"``: float16 on an accelerator (as the reference scripts), float32 on the CPU; a name of
    ``DTYPES_BY_NAME``; or a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.float16
    if name not in DTYPES_BY_NAME:
        raise ValueError(f"--dtype {name!r} is not supported; expected auto, {', '.join(DTYPES_BY_NAME)}.")
    return DTYPES_BY_NAME[name]


def quantization_kwargs(quantization: str | None, base_model_path: str | None = None) -> dict:
    """``from_pretrained`` keyword arguments for ``"8bit"``/``"4bit"`` (the bitsandbytes linear backend, see
    :mod:`eagle.model.backends.linear`); exits with why where it cannot work."""
    if quantization is None:
        return {}
    flag = f"--load-in-{quantization}"
    try:
        return BitsAndBytesLinear(int(quantization[0]), label=flag).load_options(base_model_path)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def placement_kwargs(options: ModelOptions) -> tuple[torch.device, dict]:
    """The device the model's inputs go to and the ``from_pretrained`` keyword arguments that put it there
    (``dtype``, ``device_map``, ``quantization_config``)."""
    if options.device is None and options.quantization is None:
        device = torch.device("cpu")
    else:
        device = resolve_device(options.device)
    kwargs = quantization_kwargs(options.quantization, options.base_model_path)
    if options.dtype is not None:
        kwargs["dtype"] = resolve_dtype(options.dtype, device)
    if device.type != "cpu":
        kwargs.setdefault("device_map", str(device))
    return device, kwargs


def _check_local_paths(options: ModelOptions) -> None:
    for flag, path in (("--base-model-path", options.base_model_path), ("--ea-model-path", options.ea_model_path)):
        looks_local = path is not None and (os.path.isabs(path) or path.startswith((".", "~")))
        if looks_local and not os.path.exists(os.path.expanduser(path)):
            raise FileNotFoundError(f"{flag} {path}: no such file or directory")


def head_version_hint(ea_model_path: str | None) -> int | None:
    """3 if the head's local ``config.json`` has EAGLE-3's ``draft_vocab_size``, 1 if it has a config
    without it, None when there is no local config to read."""
    if not ea_model_path or not os.path.isdir(ea_model_path):
        return None
    try:
        with open(os.path.join(ea_model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return 3 if isinstance(config, dict) and "draft_vocab_size" in config else 1


def _warn_on_head_version(ea_model_path: str, use_eagle3: bool) -> None:
    hint = head_version_hint(ea_model_path)
    wanted = 3 if use_eagle3 else 1
    if hint is not None and hint != wanted:
        logger.warning(
            "Loading %s as an EAGLE-%d head, but its config.json looks like an EAGLE-%d head%s. Pass %s if "
            "loading fails.", ea_model_path, wanted, hint,
            " (it has draft_vocab_size)" if hint == 3 else " (it has no draft_vocab_size)",
            "--use-eagle3" if hint == 3 else "--no-eagle3",
        )


def load_model(options: ModelOptions, **hf_kwargs):
    """The ``EaModel`` of ``options`` (the embedded pair filled in first). ``hf_kwargs`` go to the base model's
    ``from_pretrained`` and win over the placement ``options`` imply."""
    from eagle.model.ea_model import EaModel

    options = options.resolved()
    if options.drafter is not None:  # a drafter that drafts with a head says which version loads
        from eagle.model.drafting.registry import spec_head_version

        needed = spec_head_version(options.drafter)
        options = options if needed is None else dataclasses.replace(options, use_eagle3=needed == 3)
    _check_local_paths(options)
    _warn_on_head_version(options.ea_model_path, options.use_eagle3)
    _, kwargs = placement_kwargs(options)
    kwargs.update(hf_kwargs)
    load_head = options.ea_model_path is not None  # None only where need_head is False: the base model alone
    if load_head:
        logger.info("Loading base model %s and EAGLE-%d head %s", options.base_model_path,
                    3 if options.use_eagle3 else 1, options.ea_model_path)
    else:
        logger.info("Loading base model %s alone (no head: plain decoding only)", options.base_model_path)
    return EaModel.from_pretrained(use_eagle3=options.use_eagle3, base_model_path=options.base_model_path,
                                   ea_model_path=options.ea_model_path, pack_cpu_weights=options.pack_cpu_weights,
                                   gguf_kernels=options.gguf_kernels, draft_dtype=options.draft_dtype,
                                   load_head=load_head, drafter=options.drafter, **options.tree, **kwargs)


def load_default_model(base_model_path: str | None = None, ea_model_path: str | None = None, use_eagle3: bool = True,
                       pack_cpu_weights: bool | str = "auto", **tree_overrides):
    """``EaModel`` for the given paths, falling back to the embedded default pair for whatever is not given
    (:func:`eagle.defaults.resolve_model_paths`); the tree is the head's own for the device (see
    ``EaModel.from_pretrained``). Tree settings given as keyword arguments (``total_token``, ``depth``, ``top_k``,
    ``lookup_tokens``) win."""
    return load_model(ModelOptions(base_model_path=base_model_path, ea_model_path=ea_model_path,
                                   use_eagle3=use_eagle3, pack_cpu_weights=pack_cpu_weights, **tree_overrides))
