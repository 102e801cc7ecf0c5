"""``EaModel.from_pretrained``: load a base model and its head, resolve the tree, pick the linear backend, tune.

Each step is a function of its own module (the base model: :mod:`eagle.model.base.loading`; the head:
:mod:`eagle.model.heads.loading`; the tree a head carries: :mod:`eagle.model.tuning.head_tree`; tuning:
:mod:`eagle.model.tuning.autotune`; weight packing: :mod:`eagle.model.backends.linear`); this module puts
them in order.
"""

from __future__ import annotations

import logging

from eagle.model.drafting.batch_tree import head_batch_trees
from eagle.model.heads.loading import load_ea_layer
from eagle.model.heads.quantized import apply_draft_quantization, draft_load_dtype, quantized_at_load
from eagle.model.backends.gguf import (GGUF_KERNEL_VALUES, gguf_file_of, requested_numerics, resolve_gguf_kernels,
                                      trim_heap)
from eagle.model.backends.registry import linear_backend, switch_backend
from eagle.model.backends.onednn import should_auto_pack
from eagle.model.base.loading import direct_gguf_load_possible, load_base_model, load_gguf_direct
from eagle.model.tuning.head_tree import check_tree_arguments, head_tree_for, kernel_backend, resolve_tree

logger = logging.getLogger(__name__)


def model_paths(base_model_path, ea_model_path, kwargs: dict, load_head: bool = True) -> tuple[str, str | None]:
    """The two paths to load: as given (``eagle_model_path`` in ``kwargs`` is another name for ``ea_model_path``),
    or the embedded default pair when neither is given; with ``load_head`` False, the base model's path alone (the
    embedded base model's when none is given) and None."""
    if "eagle_model_path" in kwargs:
        alias = kwargs.pop("eagle_model_path")
        if ea_model_path is not None and ea_model_path != alias:
            raise ValueError("Pass the draft head path once: ea_model_path and eagle_model_path differ.")
        ea_model_path = alias
    if not load_head:
        if ea_model_path is not None:
            raise ValueError(f"load_head=False loads the base model alone, but a head was given ({ea_model_path!r}): "
                             "drop ea_model_path, or load the head (load_head=True).")
        if base_model_path is None:
            from eagle.defaults import default_base_model_path

            base_model_path = default_base_model_path()
        return base_model_path, None
    if base_model_path is None and ea_model_path is None:
        from eagle.defaults import default_base_model_path, default_ea_model_path

        base_model_path, ea_model_path = default_base_model_path(), default_ea_model_path()
        logger.info("No model given: the embedded default pair (%s, %s)", base_model_path, ea_model_path)
    elif base_model_path is None or ea_model_path is None:
        raise ValueError("EaModel.from_pretrained needs both base_model_path and ea_model_path, or neither (the "
                         "embedded default pair, SmolLM2-135M-Instruct with this project's head).")
    return base_model_path, ea_model_path


def apply_gguf_kernels(base_model, ea_layer, base_model_path, numerics: str, loaded: tuple | None = None) -> None:
    """The GGUF backend on ``base_model`` (its layers over the file's blocks); a head that shared the float
    embedding reads the quantized one instead, so the float copy is freed. The target's plan, built anew then,
    runs attention as the position-ordered kernel and, where the family allows, the whole forward as
    :mod:`eagle.model.base.native_decoder`'s (:meth:`~eagle.model.base.target.Target.replan`). ``loaded``: for a
    model loaded straight into the kernels, (modules on the kernels, the stand-in embedding weight the head
    tied to, see :func:`load_head_over_kernels`): nothing left to convert."""
    from eagle.model.backends.gguf import share_embedding_with_head

    if loaded is None:
        old_embedding = base_model.get_input_embeddings().weight
        count = linear_backend("gguf", gguf_path=gguf_file_of(base_model_path), numerics=numerics).convert(base_model)
    else:
        count, old_embedding = loaded
    shared = share_embedding_with_head(ea_layer, old_embedding, base_model.get_input_embeddings())
    del old_embedding
    if getattr(ea_layer, "eagle_version", None) == 1:  # an EAGLE-1 head drafts with the target's (new) LM head
        ea_layer.attach_target_lm_head(base_model.get_output_embeddings())
    logger.info("GGUF kernels (%s activations) on %d modules%s", numerics, count,
                "; the head reads the quantized embedding" if shared else "")


def load_base(base_model_path, gguf_kernels, kwargs: dict):
    """``(model, tokenizer, numerics, count)``: a GGUF file on the CPU that ``gguf_kernels`` puts on the kernels is
    loaded straight into them (:func:`eagle.model.base.loading.load_gguf_direct`, ``count`` modules on the
    kernels); anything else (``gguf_kernels=False``, another dtype or device, kernels unavailable) through
    transformers, ``count`` None and ``numerics`` from :func:`resolve_gguf_kernels` (converted later)."""
    from eagle import kernels
    from eagle.model.backends.gguf import kernel_modules

    if gguf_kernels is not False and direct_gguf_load_possible(base_model_path, kwargs):
        usable = kernels.available() if gguf_kernels == "auto" else kernels.unavailable_reason() is None
        if usable:
            numerics = requested_numerics(gguf_kernels)
            model, tokenizer = load_gguf_direct(base_model_path, numerics, **kwargs)
            return model, tokenizer, numerics, kernel_modules(model)
    model, tokenizer = load_base_model(base_model_path, **kwargs)
    return model, tokenizer, resolve_gguf_kernels(gguf_kernels, base_model_path, model), None


def load_draft_head(ea_model_path, base_model, use_eagle3: bool, draft_dtype, numerics, count: int | None):
    """``(head or None, loaded)``: the draft head at ``ea_model_path`` (None: no head), in the dtype
    ``draft_dtype`` loads it in with the target on the kernels in ``numerics`` (None: not on them), its linear
    weights in the checkpoint's dtype where it is quantized next (:func:`eagle.model.heads.loading.load_ea_layer`);
    and, for a base model loaded straight into the kernels (``count`` modules on them), the ``loaded`` of
    :func:`apply_gguf_kernels`."""
    head_dtype = draft_load_dtype(draft_dtype, numerics is not None)
    keep_linear_dtype = quantized_at_load(draft_dtype, numerics is not None)
    if ea_model_path is None:
        return None, None if count is None else (count, None)
    if count is None:
        return load_ea_layer(ea_model_path, base_model, use_eagle3, head_dtype, keep_linear_dtype), None
    head, stand_in = load_head_over_kernels(ea_model_path, base_model, use_eagle3, head_dtype, keep_linear_dtype)
    return head, (count, stand_in)


def load_head_over_kernels(ea_model_path, base_model, use_eagle3: bool, head_dtype, keep_linear_dtype=False):
    """``(head, stand_in)``: the draft head of a model whose embedding is already on the kernels. The head is built
    against a stand-in float embedding of the same shape that takes no memory (one zero, broadcast), which
    :func:`apply_gguf_kernels` then swaps for the quantized embedding (the head reads the same rows as the
    target)."""
    import torch
    from torch import nn

    quantized = base_model.get_input_embeddings()
    stand_in = nn.Embedding(quantized.num_embeddings, quantized.embedding_dim, device="meta")
    stand_in.weight = nn.Parameter(torch.zeros(1, 1).expand(quantized.num_embeddings, quantized.embedding_dim),
                                   requires_grad=False)
    base_model.set_input_embeddings(stand_in)
    try:
        head = load_ea_layer(ea_model_path, base_model, use_eagle3, head_dtype, keep_linear_dtype)
    finally:
        base_model.set_input_embeddings(quantized)
    return head, stand_in.weight


def check_options(pack_cpu_weights, thread_policy, gguf_kernels) -> None:
    """``ValueError`` naming the option and its values for a bad ``pack_cpu_weights``, ``thread_policy`` or
    ``gguf_kernels`` (before anything loads)."""
    if pack_cpu_weights not in (True, False, "auto"):
        raise ValueError(f"pack_cpu_weights must be True, False or 'auto', not {pack_cpu_weights!r}.")
    if not isinstance(thread_policy, bool):
        raise ValueError(f"thread_policy must be True or False, not {thread_policy!r}.")
    if not (gguf_kernels is False or (isinstance(gguf_kernels, str) and gguf_kernels in GGUF_KERNEL_VALUES)):
        raise ValueError(f"gguf_kernels must be 'auto', 'float32', 'int8' or False, not {gguf_kernels!r}.")


def convert_weights(base_model, ea_layer, base_model_path, pack_cpu_weights, numerics: str | None,
                    draft_dtype="auto", loaded: tuple | None = None) -> None:
    """The linear backends ``from_pretrained``'s options ask for: the GGUF kernels first in ``numerics`` (None:
    none; see :func:`apply_gguf_kernels`), the head's Q8_0 layers where ``draft_dtype`` asks for them
    (:mod:`eagle.model.heads.quantized`), then oneDNN packing of the layers still float (whether to pack is decided
    on the model as loaded, so the head of a converted model is packed as before)."""
    pack = pack_cpu_weights is True or (pack_cpu_weights == "auto" and should_auto_pack(base_model))
    if numerics is not None:
        apply_gguf_kernels(base_model, ea_layer, base_model_path, numerics, loaded)
    if ea_layer is not None:
        apply_draft_quantization(ea_layer, base_model, draft_dtype, numerics is not None)
    if numerics is not None:
        # the staging of the load and the head's float weights are freed by now; glibc would keep them mapped (at the
        # 8B widened shape 0.1-0.26 GB of resident memory, more with the packed weights in their own huge-page maps).
        # A trim alone gives the same resident memory as with a garbage collection first, without its ~0.25 s.
        trim_heap()
    if pack:
        count = switch_backend("onednn", True, base_model, ea_layer)
        logger.info("Packed the CPU weights of %d linear layers for oneDNN (pack_cpu_weights=%r)", count,
                    pack_cpu_weights)


def load_pretrained(cls, *, use_eagle3: bool | None, base_model_path, ea_model_path, tree: dict, threshold: float,
                    pack_cpu_weights, draft_dtype, thread_policy: bool = True, gguf_kernels="auto", load_head=True,
                    drafter=None, **kwargs):
    """An ``EaModel`` (``cls``) for the base model at ``base_model_path`` (a directory, a Hub id, or a ``.gguf``
    file / directory holding one) and the head at ``ea_model_path`` (``config.json`` + ``model.safetensors`` or
    ``pytorch_model.bin``); with neither path, the embedded default pair (nothing is downloaded). Other keyword
    arguments go to the base model's ``from_pretrained`` (``dtype``/``torch_dtype``, ``device_map``...).

    ``tree`` (``total_token`` nodes verified per step, root included; ``depth``; ``top_k``; ``lookup_tokens``):
    each setting not given (None) comes from the tree the head carries for this kind of device (its config.json's
    ``eagle_tree``), else from the reference's 60/7/10 without lookup; ``total_token=-1`` tunes the tree on this
    device (the settings given stay fixed; cached). ``threshold`` is the reference's, accepted and unused.

    ``pack_cpu_weights``: the oneDNN linear backend: ``"auto"`` packs float32 CPU models whose linear weights take
    at most 2 GiB; ``True`` packs whatever can be packed; ``False`` leaves the layers alone. ``draft_dtype``: the
    head's dtype (``"auto"``: with the target on the GGUF kernels, ``"q8_0"`` for an EAGLE-3 head; else bfloat16
    for the EAGLE-3 head of a float32 model on a CPU that computes in bfloat16 natively, else the base model's;
    ``"q8_0"`` / ``"q4_0"``: its linear layers over Q8_0 / Q4_0 blocks of its weights with int8 activations on
    eagle's kernels, see :mod:`eagle.model.heads.quantized`); the output never depends on it. ``allow_unknown_attention`` (default False):
    serve a base model whose attention EAGLE's tree masks may not reproduce exactly (a layer type or feature of
    :mod:`eagle.model.base.families`; remote code failing the mask check) instead of refusing it.
    ``thread_policy``: True (default) lets the generation loop of a CPU model choose torch's thread count as the
    machine is now (fewer when other programs take CPUs, :mod:`eagle.utils.threads`), unless the user set the count
    (``OMP_NUM_THREADS``, ``torch.set_num_threads``); the output never depends on it.

    ``gguf_kernels``: for a GGUF base model on the CPU, the linear layers, embedding and LM head compute over the
    file's quantized blocks and attention runs the position-ordered kernel (:mod:`eagle.model.backends.gguf`):
    ``"auto"`` (int8 activations, what llama.cpp computes, where the kernels are available, else the float32 model
    with one warning), ``"int8"``, ``"float32"`` (float32 activations: equal to transformers' float32 model, about
    1.5-2x slower) or ``False`` (the float32 model transformers dequantizes); each picks the tree the head carries
    for its numerics. oneDNN packing then applies to the head (and any layer the kernels leave float). A GGUF
    file loaded in float32 on the CPU (no ``device_map``) goes straight into the kernels, without a float32 model
    (:func:`eagle.model.base.loading.load_gguf_direct`: about the file's size in memory); other loads convert
    transformers' float32 model.

    ``load_head=False``: the base model alone (no ``ea_model_path``), for plain decoding on the same engine and
    backends (``naivegenerate``, ``generate(use_eagle=False)``, the benchmark's head-less baselines); EAGLE
    generation then says the model has no head. ``drafter``, ``use_eagle3``: :func:`head_loads_as_eagle3`."""
    del threshold  # the reference's EAGLE-2 drafting never reads it either
    allow_unknown_attention = bool(kwargs.pop("allow_unknown_attention", False))
    use_eagle3 = head_loads_as_eagle3(drafter, use_eagle3, load_head)
    check_options(pack_cpu_weights, thread_policy, gguf_kernels)
    check_tree_arguments(**tree)  # invalid settings fail before loading
    base_model_path, ea_model_path = model_paths(base_model_path, ea_model_path, kwargs, load_head)
    base_model, tokenizer, numerics, count = load_base(base_model_path, gguf_kernels, kwargs)
    ea_layer, loaded = load_draft_head(ea_model_path if load_head else None, base_model, use_eagle3, draft_dtype,
                                       numerics, count)
    head_config = {} if ea_layer is None else ea_layer.config
    device = base_model.get_input_embeddings().weight.device
    backend = kernel_backend(numerics)  # the kernels' costs call for a tree of their own
    settings, sources = resolve_tree(tree, head_tree_for(head_config, device, backend))
    model = cls(base_model, ea_layer, tokenizer, settings.total_token, settings.depth, settings.top_k,
                base_model_name_or_path=base_model_path, use_eagle3=use_eagle3,
                lookup_tokens=settings.lookup_tokens, ea_model_path=ea_model_path, thread_policy=thread_policy,
                allow_unknown_attention=allow_unknown_attention, drafter=drafter)
    convert_weights(base_model, ea_layer, base_model_path, pack_cpu_weights, numerics, draft_dtype, loaded)
    if numerics is not None:
        model.engine.target.replan()  # its layers are on the kernels now
    finish_tree(model, tree, sources, head_config, device, backend)
    return model


def head_loads_as_eagle3(drafter: str | None, use_eagle3: bool | None, load_head: bool) -> bool:
    """Whether the head loads as EAGLE-3 (``use_eagle3``, the reference's; None: unless ``drafter``, the model's
    default drafter spec, drafts with an EAGLE-1 head), after checking ``drafter`` as far as it can be before
    loading (it is checked against the loaded head later): a ``ValueError`` for an unknown name, a boolean that
    contradicts it, or a drafter needing a head with ``load_head=False``."""
    from eagle.model.drafting.registry import check_drafter, reference_drafter, spec_head_version

    if drafter is None:
        return True if use_eagle3 is None else use_eagle3
    reference_drafter(drafter, use_eagle3=use_eagle3)
    if not load_head:
        check_drafter(drafter, None)
    needed = spec_head_version(drafter)
    return needed != 1 if use_eagle3 is None else use_eagle3


def finish_tree(model, tree: dict, sources: dict, head_config, device, backend) -> None:
    """The tree settings of ``model`` once loaded: tuned on this device (``total_token=-1``) or logged, and the
    head's batch trees where no setting was given. A base model alone drafts no tree: nothing to do."""
    if model.ea_layer is None:
        return
    if tree.get("total_token") == -1:
        from eagle.model.tuning.autotune import tune_tree

        fixed = {key: value for key, value in tree.items() if value is not None and key != "total_token"}
        model.tree_settings = tune_tree(model, fixed=fixed)
    else:
        logger.info("Tree %s (%s)", model.tree_settings.describe(),
                    ", ".join(f"{key} from the {source}" if source != "argument" else f"{key} given"
                              for key, source in sources.items()))
    if all(value is None for value in tree.values()):  # an explicit tree applies to every batch size
        model.set_batch_trees(head_batch_trees(head_config, device, model.tree_settings, backend))
        if model.batch_trees:
            logger.info("Batch trees: %s", model.engine.plan.describe_batches())
