"""The GGUF linear backend: a GGUF-loaded model's linear layers computed over the file's own quantized blocks.

transformers dequantizes a GGUF file to float32 when it loads it (every forward then reads about 5.5x the file's
bytes). :func:`convert_gguf_model` replaces, in place, every ``nn.Linear`` whose weight comes from a GGUF tensor the
native kernels handle with a :class:`GGUFQuantLinear` over that tensor's blocks (:mod:`eagle.kernels.linear`), the
token embedding with a :class:`~eagle.kernels.linear.QuantEmbedding`, and a tied LM head with a
``GGUFQuantLinear`` over the same ``token_embd`` blocks (shared with the embedding, not copied), and a
mixture-of-experts layer's stacked experts and router with kernel modules over each expert's slice
(:mod:`eagle.model.backends.gguf_experts`); the float32 copies are freed. Every replaced weight is checked at
load: its blocks must dequantize to exactly the float32 tensor transformers built (``torch.equal``), else a
ValueError names the tensor. A tensor type the kernels do not handle stays a float layer (logged once per type).

:func:`fill_from_gguf` builds the same modules without a float32 model: over a model built on the meta device
(:func:`eagle.model.base.loading.load_gguf_direct`), it reads the file one tensor at a time, installs the kernel
modules, makes the other parameters (norms, biases, layers of a type the kernels do not handle) float32 as
transformers does, and computes the buffers; :func:`verify_kernel_weights` is then the check above, one tensor at
a time against gguf-py's dequantization of the file.

The kernels are row-invariant (a token's output bits do not depend on the other rows of the call), which is what
makes greedy EAGLE's logits bit-equal to plain decoding's; a target over a model on the kernels also runs its
attention as the position-ordered kernel (:class:`eagle.model.base.plan.ForwardPlan`).

``gguf_kernels`` (``EaModel.from_pretrained``, ``--gguf-kernels``) is the one switch of the numerics:

- ``"auto"`` (default): :data:`AUTO_NUMERICS`, int8 activations, for a GGUF model on the CPU when the kernels are
  available (else the float32 model transformers builds, with one warning).
- ``"int8"``: activations quantized to int8 per block of 32, exact integer dot products per weight block, combined
  in float32: what llama.cpp computes. Its logits are close to transformers' float32 model's, not equal (each
  activation rounded to 8 bits), so a greedy token can differ where two were nearly tied; greedy EAGLE equals its
  own plain decoding bit for bit. The faster numerics: 1.5x float32 activations' tokens/s on the embedded 135M
  model, 2x at 1B (2 threads).
- ``"float32"``: float32 activations times exactly transformers' float32 weights: transformers' float32 model on
  the dequantized weights, to float rounding (its greedy tokens equal transformers' ``generate`` in the tests);
  greedy EAGLE equals its own plain decoding bit for bit. About 1.5-2x slower than int8.
- ``False``: no kernels, the float32 model transformers dequantizes (about 5.5x the file's memory).
"""

from __future__ import annotations

import gc
import logging

import torch
from torch import nn

from eagle.kernels.gguf_weights import GGUFWeight, llama_qk_row_order, read_gguf_weights
from eagle.kernels.linear import QuantEmbedding, QuantLinear, kernel_handles
from eagle.model.backends.gguf_experts import convert_gguf_experts
from eagle.model.backends.linear import PlainLinear, current_real_rows
from eagle.utils.gguf_paths import gguf_file_of

logger = logging.getLogger(__name__)

GGUF_KERNEL_VALUES = ("auto", "float32", "int8", False)
# The numerics ``gguf_kernels="auto"`` runs the kernels with (module docstring: what each value equals and costs).
AUTO_NUMERICS = "int8"
# The command-line choice (``--gguf-kernels``) -> ``EaModel.from_pretrained(gguf_kernels=...)``.
GGUF_FLAG_VALUES = {"auto": "auto", "float32": "float32", "int8": "int8", "off": False}
_logged: set[str] = set()


def add_gguf_kernels_argument(parser) -> None:
    """``--gguf-kernels auto|float32|int8|off``; ``GGUF_FLAG_VALUES[args.gguf_kernels]`` is the value for
    ``EaModel.from_pretrained(gguf_kernels=...)``."""
    parser.add_argument("--gguf-kernels", choices=list(GGUF_FLAG_VALUES), default="auto",
                        help="a GGUF base model on the CPU computes over the file's quantized blocks with eagle's "
                        "native kernels: int8 activations (auto, int8: what llama.cpp computes, the faster) or "
                        "float32 activations (float32: equal to transformers' float32 model, about 1.5-2x slower); "
                        "off = the float32 model transformers dequantizes (default: auto)")


class GGUFQuantLinear(QuantLinear):
    """A :class:`~eagle.kernels.linear.QuantLinear` that computes the real rows of a padded call alone
    (:func:`~eagle.model.backends.linear.current_real_rows`): exact, since each row's bits depend on that
    row only; padding rows get zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = current_real_rows()
        if rows is None or not rows.matches(x):
            return super().forward(x)
        return rows.scatter(super().forward(rows.gather(x))).reshape(*x.shape[:-1], self.out_features)


class ScaledQuantEmbedding(QuantEmbedding):
    """A :class:`QuantEmbedding` times a constant, as Gemma's scaled word embedding computes it
    (``embedding(ids) * embed_scale`` in the weight's dtype)."""

    def __init__(self, table, embed_scale: torch.Tensor):
        super().__init__(table)
        self.register_buffer("embed_scale", torch.as_tensor(embed_scale).detach().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(torch.float32)


# ------------------------------------------------------------------------------------------------ the option
def requested_numerics(value: str) -> str:
    """The numerics a ``gguf_kernels`` value other than False asks the kernels for: ``"auto"`` is
    :data:`AUTO_NUMERICS`, ``"float32"`` / ``"int8"`` themselves."""
    return AUTO_NUMERICS if value == "auto" else value


def resolve_gguf_kernels(value, base_model_path, model) -> str | None:
    """The numerics the kernels run ``model`` with (``"float32"`` / ``"int8"``), or None for the float32 model.

    ``"auto"`` uses them (:data:`AUTO_NUMERICS`) for a float32 GGUF model on the CPU when the kernels are
    available (else None, with one
    warning from :func:`eagle.kernels.available`); ``"float32"`` / ``"int8"`` where they cannot work are a
    ValueError that says why; ``False`` is None."""
    if value is False:
        return None
    if not (isinstance(value, str) and value in GGUF_KERNEL_VALUES):
        raise ValueError(f"gguf_kernels must be 'auto', 'float32', 'int8' or False, not {value!r}.")
    from eagle import kernels

    explicit = value != "auto"
    problem = None
    weight = model.get_input_embeddings().weight
    if gguf_file_of(base_model_path) is None:
        problem = f"the base model {base_model_path} is not a GGUF file"
    elif weight.device.type != "cpu":
        problem = f"the model runs on {weight.device}, the kernels on the CPU only"
    elif weight.dtype != torch.float32:
        problem = f"the model was loaded in {weight.dtype}; the kernels compute in float32"
    elif not explicit and not kernels.available():  # logs why, once
        return None
    elif explicit and kernels.unavailable_reason() is not None:
        problem = f"eagle's native kernels are unavailable: {kernels.unavailable_reason()}"
    if problem is None:
        return requested_numerics(value)
    if explicit:
        raise ValueError(f"gguf_kernels={value!r} cannot be used: {problem}. Pass gguf_kernels=False (or 'auto').")
    return None


# ------------------------------------------------------------------------------------------------ the names
def gguf_architecture(gguf_path: str, metadata: dict | None = None) -> str:
    """The file's ``general.architecture`` (gguf-py's architecture name: ``llama``, ``qwen2``, ``gemma3``...), from
    its ``metadata`` where the caller has parsed it already (:attr:`GGUFTensorFile.metadata`)."""
    from eagle.kernels.gguf_check import read_gguf_header

    if metadata is None:
        metadata = read_gguf_header(gguf_path).metadata
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise ValueError(f"{gguf_path} has no general.architecture: not a model GGUF file")
    return architecture


def hf_to_gguf_names(model, architecture: str, hf_names=None) -> dict[str, str]:
    """HF parameter name (``model.layers.0.self_attn.q_proj.weight``) -> GGUF tensor name (``blk.0.attn_q.weight``),
    from gguf-py's tensor-name table for ``architecture``, the table transformers' GGUF loading reads
    (``get_gguf_hf_weights_map`` builds the same map, once per submodule: seconds for a small model). ``hf_names``:
    the names to map (default: ``model``'s state dict)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"gguf-py has no tensor-name table for the GGUF architecture {architecture!r}")
    table = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    names = {}
    for hf_name in model.state_dict(keep_vars=True) if hf_names is None else hf_names:
        base, dot, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(base) if dot else None
        if gguf_name is not None:
            names[hf_name] = f"{gguf_name}.{suffix}"
    return names


def llama_permuted(architecture: str) -> bool:
    """Whether transformers permutes the Q / K rows of a file of this architecture when it loads it (its Llama
    tensor processor: llama.cpp stores them interleaved for its rotary embedding)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture)
    return processor is not None and issubclass(processor, LlamaTensorProcessor)


def _hf_rows(weight: GGUFWeight, hf_name: str, config, permuted: bool) -> GGUFWeight:
    """``weight`` with its rows in the order transformers' model holds them (Llama-family Q / K permutation)."""
    if not permuted or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return weight
    heads = config.num_attention_heads
    if hf_name.endswith("k_proj.weight"):
        heads = getattr(config, "num_key_value_heads", None) or heads
    return weight.permute_rows(llama_qk_row_order(weight.out_features, heads))


def _check_equal(quant: nn.Module, dense: torch.Tensor, gguf_name: str) -> None:
    """The replaced layer's weight must be exactly the float32 weight transformers built (nothing to compare with
    on a model built without float weights: ``dense`` on the meta device)."""
    if dense.is_meta:
        return
    weight = quant.weight.dequantized()
    if weight.shape != dense.shape or not torch.equal(weight, dense.detach().to(weight.device)):
        raise ValueError(f"GGUF tensor {gguf_name!r}: its blocks do not dequantize to the float32 weight transformers "
                         f"built from it (shape {tuple(weight.shape)} vs {tuple(dense.shape)}); refusing to compute "
                         f"with different weights. Load with gguf_kernels=False.")


def _note_unhandled(what: str) -> None:
    if what not in _logged:
        _logged.add(what)
        logger.warning("GGUF kernels: %s stays a float32 layer.", what)


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``model``'s submodule ``name`` (a dotted path) is."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def release_freed_memory() -> None:
    """Collect garbage and hand freed heap memory back to the system (:func:`trim_heap`), so that resident memory
    shows the float32 weights gone (without it, glibc keeps most of them mapped for reuse)."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Hand heap memory already freed back to the system (glibc's ``malloc_trim``; nothing elsewhere). Unlike
    :func:`release_freed_memory` it collects no garbage, which takes a quarter of a second with a ~2B model loaded."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


# ------------------------------------------------------------------------------------------------ converting
def _convert_linears(model, weights, names, numerics, permuted, skip: set[str]) -> int:
    """Replace every nn.Linear with a GGUF tensor the kernels handle; returns how many."""
    config = model.config.get_text_config()
    count = 0
    for name, layer in list(model.named_modules()):
        if type(layer) is not nn.Linear or name in skip:
            continue
        gguf_name = names.get(f"{name}.weight")
        if gguf_name is None or gguf_name not in weights:
            _note_unhandled(f"{name} (no GGUF tensor maps to it)")
            continue
        weight = _as_matrix(weights[gguf_name], layer)
        if not kernel_handles(weight.type_name) or len(weight.shape) != 2:
            _note_unhandled(f"GGUF type {weight.type_name} ({gguf_name} and any like it)")
            continue
        quant = GGUFQuantLinear(_hf_rows(weight, f"{name}.weight", config, permuted), layer.bias, numerics)
        _check_equal(quant, layer.weight, gguf_name)
        set_module(model, name, quant)
        count += 1
    return count


def _as_matrix(weight: GGUFWeight, layer: nn.Linear) -> GGUFWeight:
    """A GGUF vector stored for a one-output linear layer (a shared expert's gate) as its (1, K) matrix."""
    if len(weight.shape) == 1 and tuple(layer.weight.shape) == (1, weight.shape[0]):
        return GGUFWeight(weight.name, weight.type_name, (1, weight.shape[0]), weight.blocks.reshape(1, -1))
    return weight


def _convert_embeddings(model, weights, names, numerics) -> tuple[int, set[str]]:
    """The token embedding and a tied LM head over the same blocks; returns (count, replaced module names)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    module_names = {id(m): n for n, m in model.named_modules()}
    embed_name, head_name = module_names.get(id(embedding)), module_names.get(id(head))
    gguf_name = names.get(f"{embed_name}.weight")
    table = weights.get(gguf_name) if embed_name is not None else None
    if table is None or not kernel_handles(table.type_name):
        _note_unhandled(f"the token embedding ({gguf_name})")
        return 0, set()
    tied = (head is not None and type(head) is nn.Linear and head.weight is embedding.weight and head.bias is None)
    shared = GGUFQuantLinear(table, None, numerics) if tied else table
    scale = getattr(embedding, "embed_scale", None)
    new_embedding = QuantEmbedding(shared) if scale is None else ScaledQuantEmbedding(shared, scale)
    _check_equal(new_embedding, embedding.weight, gguf_name)
    set_module(model, embed_name, new_embedding)
    if not tied:
        return 1, set()
    set_module(model, head_name, shared)
    return 2, {head_name}


def convert_gguf_model(model: nn.Module, gguf_path: str, numerics: str = "float32", weights=None,
                       release: bool = True) -> int:
    """Replace ``model``'s linear layers, embedding and tied LM head by kernels over the GGUF file's blocks (module
    docstring), in place; returns how many modules changed. Raises ValueError naming a tensor whose blocks do not
    give transformers' float32 weight. ``weights``: the file's tensors by name (default: every tensor, viewed
    through a memory map; a :class:`~eagle.kernels.gguf_weights.GGUFTensorFile` reads them one at a time).
    ``release``: hand the freed float weights' memory back to the system afterwards (False for a model built on
    the meta device, whose linear layers and embedding held none: :func:`fill_from_gguf`)."""
    weights = read_gguf_weights(gguf_path) if weights is None else weights
    architecture = gguf_architecture(gguf_path)
    names, permuted = hf_to_gguf_names(model, architecture), llama_permuted(architecture)
    with torch.no_grad():
        count, skip = _convert_embeddings(model, weights, names, numerics)
        count += _convert_linears(model, weights, names, numerics, permuted, skip)
        count += convert_gguf_experts(model, weights, names, numerics, _check_equal)
    del weights
    if release:
        release_freed_memory()
    logger.info("GGUF kernels (%s numerics): %d modules compute over the blocks of %s", numerics, count, gguf_path)
    return count


# ------------------------------------------------------------------------------------------------ direct loading
# transformers' per-tensor GGUF processors that read one tensor alone (no other tensor, no state across tensors):
# the float parameters of a model built without float weights go through them one at a time. Qwen2-MoE's merges a
# layer's stacked gate and up experts into one parameter, but only those: a direct load puts the experts on the
# kernels from the file's blocks (:mod:`eagle.model.backends.gguf_experts`) and never builds that parameter; every
# other tensor it processes alone.
_PER_TENSOR_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor", "NemotronTensorProcessor",
                          "Qwen2MoeTensorProcessor")
# The GGUF architectures whose direct load is tested bit for bit against the float32-then-convert path (the embedded
# SmolLM2 file, Gemma 3 270M Q4_K_M, tiny random Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE files); other architectures
# load through the float32 model until a test covers them. A Mistral GGUF says ``llama``.
DIRECT_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


def direct_processor(architecture: str, config):
    """transformers' tensor processor for a GGUF of ``architecture`` (the one its float32 loading applies: Gemma's
    norms minus one, Llama's Q / K rows reordered), or None where the file cannot be loaded tensor by tensor
    (a processor that merges tensors, or an architecture transformers loads through its newer GGUF path)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    if not loads_tensor_by_tensor(architecture):
        return None
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.get_text_config().to_dict())


def loads_tensor_by_tensor(architecture: str) -> bool:
    """Whether :func:`fill_from_gguf` can load a GGUF of ``architecture`` (see :func:`direct_processor`)."""
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    if architecture not in DIRECT_ARCHITECTURES:
        return False
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    return processor.__name__ in _PER_TENSOR_PROCESSORS and not is_gguf_arch_supported(architecture)


def float_from_gguf(weight: GGUFWeight, processor) -> torch.Tensor:
    """The float32 tensor transformers' GGUF loading makes of ``weight``: gguf-py's ``dequantize`` of its blocks,
    then ``processor``'s change for that tensor name."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(weight.blocks.numpy(), GGMLQuantizationType[weight.type_name]).reshape(weight.shape)
    values = processor.process(weights=values, name=weight.name, tensor_key_mapping={},
                               parsed_parameters={"config": processor.config, "tensors": {}}).weights
    return torch.from_numpy(np.copy(values)).to(torch.float32)


def load_float_parameters(model: nn.Module, tensors, names: dict[str, str], processor, select=None) -> int:
    """Every parameter of ``model`` still on the meta device (and passing ``select(module, name)``) made a float32
    parameter from its GGUF tensor (:func:`float_from_gguf`), one tensor at a time; a parameter shared by several
    modules (a tied LM head) stays shared. Returns how many tensors were read."""
    made: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not param.is_meta or (select is not None and not select(module, name)):
                continue
            if id(param) not in made:
                gguf_name = names.get(f"{module_name}.{name}" if module_name else name)
                if gguf_name is None or gguf_name not in tensors:
                    continue  # no tensor: check_materialized names it
                values = float_from_gguf(tensors[gguf_name], processor)
                if values.shape != param.shape:
                    raise ValueError(f"GGUF tensor {gguf_name!r} of {tensors.path} has shape {tuple(values.shape)}, "
                                     f"but the model built from its metadata expects {tuple(param.shape)}.")
                made[id(param)] = nn.Parameter(values, requires_grad=param.requires_grad)
            setattr(module, name, made[id(param)])
    return len(made)


def init_buffers(model: nn.Module) -> None:
    """The buffers of a model built on the meta device (rotary frequencies, Gemma's embedding scale) computed on the
    CPU as transformers computes them when it loads a model (empty tensors, then the model's ``_init_weights`` of
    their module)."""
    with torch.no_grad():
        for module in model.modules():
            meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            if meta:
                model._init_weights(module)


def check_materialized(model: nn.Module, gguf_path: str) -> None:
    """ValueError naming the first parameter or buffer left on the meta device (no tensor of the file filled it)."""
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in items:
            if tensor.is_meta:
                raise ValueError(f"{gguf_path} has no tensor for the model's {kind} {name!r} (expected one that "
                                 "gguf-py's tensor-name table maps to it); the model cannot be built from this file.")


def verify_kernel_weights(model: nn.Module, gguf_path: str, processor=None) -> int:
    """Check that every kernel module of ``model`` (loaded from ``gguf_path``) dequantizes to exactly the float32
    weight transformers builds from the file's tensor (:func:`float_from_gguf`), reading one tensor at a time;
    returns how many were checked. ValueError naming the first tensor that differs."""
    from eagle.kernels.gguf_weights import GGUFTensorFile

    tensors = GGUFTensorFile(gguf_path)
    architecture = gguf_architecture(gguf_path, tensors.metadata)
    processor = processor or direct_processor(architecture, model.config)
    kernel_layers = {f"{name}.weight": m for name, m in model.named_modules()
                     if isinstance(m, (QuantLinear, QuantEmbedding))}
    checked = 0
    for hf_name, gguf_name in hf_to_gguf_names(model, architecture, kernel_layers).items():
        if gguf_name in tensors:  # a tied LM head has none: its blocks are the embedding's
            _check_equal(kernel_layers[hf_name], float_from_gguf(tensors[gguf_name], processor), gguf_name)
            checked += 1
    return checked


def _is_matrix_weight(module: nn.Module, name: str) -> bool:
    return name == "weight" and isinstance(module, (nn.Linear, nn.Embedding))


def fill_from_gguf(model: nn.Module, gguf_path: str, numerics: str = "float32", processor=None,
                   verify: bool = False) -> int:
    """A model built on the meta device (no float weights) filled from the GGUF file, in place: its linear layers,
    embedding and tied LM head the same kernel modules :func:`convert_gguf_model` installs, over the file's blocks
    read one tensor at a time; norms, biases and any layer the kernels do not handle float32 as transformers
    builds them (:func:`float_from_gguf`); buffers as transformers computes them. Returns how many modules compute
    on the kernels. ValueError where the file lacks a tensor the model has. ``verify``: then check each kernel
    module against transformers' float32 weight (:func:`verify_kernel_weights`; dequantizes every weight once)."""
    from eagle.kernels.gguf_weights import GGUFTensorFile

    tensors = GGUFTensorFile(gguf_path)
    architecture = gguf_architecture(gguf_path, tensors.metadata)
    processor = processor or direct_processor(architecture, model.config)
    if processor is None:
        raise ValueError(f"{gguf_path}: transformers' loading of a {architecture!r} GGUF does not go tensor by "
                         "tensor; load it with gguf_kernels=False.")
    names = hf_to_gguf_names(model, architecture)
    init_buffers(model)
    with torch.no_grad():
        load_float_parameters(model, tensors, names, processor, lambda m, n: not _is_matrix_weight(m, n))
        count = convert_gguf_model(model, gguf_path, numerics, weights=tensors, release=False)
        load_float_parameters(model, tensors, names, processor)  # layers the kernels do not handle
    check_materialized(model, gguf_path)
    if verify:
        verify_kernel_weights(model, gguf_path, processor)
    return count


def share_embedding_with_head(head: nn.Module, old_weight: torch.Tensor, embedding: nn.Module) -> bool:
    """A draft head that read the target's float32 embedding (``old_weight``, shared) reads its
    :class:`QuantEmbedding` instead (same rows, bit for bit), so the float copy is freed. Returns whether it did."""
    own = getattr(head, "embed_tokens", None)
    if own is None or getattr(own, "weight", None) is not old_weight or not isinstance(embedding, QuantEmbedding):
        return False
    head.embed_tokens = embedding
    return True


def kernel_modules(model: nn.Module) -> int:
    """How many of ``model``'s modules compute over GGUF blocks (linear layers, embedding, LM head)."""
    return sum(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())


def kernel_numerics(model: nn.Module) -> str | None:
    """The numerics (``"float32"`` / ``"int8"``) ``model``'s linear layers run with on the kernels, None when none
    does."""
    return next((m.numerics for m in model.modules() if isinstance(m, QuantLinear) and m.uses_kernels), None)


class GGUFLinear(PlainLinear):
    """The GGUF kernels as a :class:`~eagle.model.backends.linear.LinearBackend` (module docstring)."""

    name = "gguf"

    def __init__(self, gguf_path: str | None = None, numerics: str = "float32"):
        self.gguf_path, self.numerics = gguf_path, numerics

    def convert(self, module) -> int:
        """The model's linear layers over the file's blocks. A target built over ``module`` before keeps its plan
        until :meth:`~eagle.model.base.target.Target.replan` builds one for the new layers."""
        if self.gguf_path is None:
            raise ValueError("The gguf linear backend needs the GGUF file the model was loaded from "
                             "(linear_backend('gguf', gguf_path=...)).")
        return convert_gguf_model(module, self.gguf_path, self.numerics)

    def restore(self, module) -> int:
        """The QuantLinear layers back to float32 ``nn.Linear`` with the same (dequantized) weights (the embedding
        stays a QuantEmbedding). A target built over ``module`` before keeps its plan until
        :meth:`~eagle.model.base.target.Target.replan` builds one for the float layers."""
        count = 0
        for name, layer in list(module.named_modules()):
            if isinstance(layer, QuantLinear):
                dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
                dense.weight = nn.Parameter(layer.dequantized_weight().clone(), requires_grad=False)
                if layer.bias is not None:
                    dense.bias = nn.Parameter(layer.bias.clone(), requires_grad=False)
                set_module(module, name, dense)
                count += 1
        return count
