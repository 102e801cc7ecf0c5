"""Attention backends: the one module that touches transformers' attention internals.

The target runs as the stock transformers class; tree attention is a 4-D mask that its SDPA and eager attention
honour as given. What our forward passes change in the attention is chosen once, when a target is built
(:class:`~eagle.model.base.plan.ForwardPlan`), and reaches the attention function as a keyword argument of each
model call (:class:`OurPass`): transformers passes the extra keyword arguments of a model call down to the
attention function. Nothing is switched around a pass, so another caller of the same model (a thread, the model's
own ``generate``) computes meanwhile what it always computes.

Each touch of transformers internals is named in :data:`TRANSFORMERS_TOUCHES` and tested against the pinned
transformers (``tests/test_attention_backend.py``):

- ``register``: ``AttentionInterface.register`` / ``AttentionMaskInterface.register`` (public) add
  :func:`eagle_sdpa` and :func:`eagle_eager` under the names of :data:`OUR_ATTENTION`, with SDPA's and eager's own
  mask builders;
- ``select``: the config's ``_attn_implementation_internal`` (private: transformers' public
  ``set_attn_implementation`` also rewrites the configs of sub-models) names ours instead of ``"sdpa"`` /
  ``"eager"``, once, when the target is built (:func:`select_our_attention`). Given no :class:`OurPass`, ours call
  exactly the function the name replaced, so the model's own ``generate`` and other callers compute what they
  computed, bit for bit. Set anew afterwards (``set_attn_implementation``), the target refuses its passes until
  :meth:`~eagle.model.base.target.Target.replan`, and a query temperature taken over applies only under ours;
- ``call_kwargs``: the keyword arguments of a model call (``TransformersKwargs``) reach the attention function:
  :data:`PASS_ARGUMENT` carries our pass's choices, :data:`POSITIONS_ARGUMENT` the query positions of a module
  with a query temperature;
- ``delegate``: ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` (module path) computes what
  :func:`tree_sdpa_attention` does not handle itself, and every SDPA call of someone else;
- ``module_eager``: the modeling module's own ``eager_attention_forward`` (module attribute), which
  :func:`eagle_eager` calls (a family's eager function may differ from the generic one);
- ``query_temperature``: Llama-4's NoPE layers scale their queries by a temperature of the query position, which
  the attention module computes from its cache's length (``attn_temperature_tuning``, ``use_rope``,
  ``floor_scale``, ``attn_scale``, ``layer_idx`` of ``Llama4TextAttention``; the ``cache`` and ``hidden_states``
  its decoder layer passes it). A tree node's cache slot is not its position, so when the target is built the
  module's own scaling is switched off, once, and our functions apply the same formula
  (:class:`QueryTemperature`): to the positions our pass gives, or else to the positions the module would have
  computed, which a forward pre-hook on the module reads from its cache as the module did;
- ``kernel``: with the GGUF kernels, our passes run :func:`eagle.kernels.attention.attention_forward` (the
  position-ordered, batch-invariant kernel, written to transformers' attention-function signature and keyword
  arguments) in every layer, so prefill, plain decoding and tree verification all run one kernel, whose bits for
  a token do not depend on the other queries of the call.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

SUPPORTED_ATTENTION = ("sdpa", "eager")
# The model's attention implementation -> the name ours is registered under (when a target is built, not on import).
OUR_ATTENTION = {"sdpa": "eagle_sdpa", "eager": "eagle_eager"}
# The keyword argument of a model call that carries our pass (OurPass) down to the attention functions.
PASS_ARGUMENT = "eagle_pass"
# The keyword argument a query-temperature module's hook adds: the (B, T) or (T,) positions of its queries.
POSITIONS_ARGUMENT = "eagle_query_positions"


@dataclass(frozen=True)
class OurPass:
    """What one of our forward passes asks of the attention: ``attend``, the attention function to run (with
    transformers' attention-function signature), and ``positions``, the (B, T) query positions that a module with a
    query temperature scales its queries by (None: the positions transformers would use, from the cache length)."""

    attend: Callable
    positions: torch.Tensor | None = None


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' SDPA attention, except for several queries under a mask with grouped key/value heads on a CPU.

    There transformers repeats every key and value head for its query heads before calling SDPA (``repeat_kv``: a
    copy of the layer's whole cache, each layer, each verification), because on CUDA a masked grouped call would
    fall back to a slow kernel. On a CPU, SDPA's own ``enable_gqa`` computes the same numbers (bitwise, checked in
    the tests) without the copy (timings: docs/PERFORMANCE.md). Everything else goes to transformers' function
    unchanged.
    """
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = not any(kwargs.get(name) is not None for name in ("position_bias", "s_aux", "softcap"))
    if (grouped and plain and attention_mask is not None and query.shape[2] > 1 and query.device.type == "cpu"
            and not module.training):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                          is_causal=is_causal, **kwargs)


def sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA attention function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def module_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention: its modeling module's ``eager_attention_forward``."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return eager(module, query, key, value, attention_mask, **kwargs)


def _attend(default: Callable, module, query, key, value, attention_mask, ours: OurPass | None,
            positions: torch.Tensor | None, kwargs: dict):
    """The query temperature where the module has one (``positions``), then the function our pass asks for, or
    ``default`` when the call is not one of our passes."""
    if positions is not None:
        query = QueryTemperature.apply(module, query, positions)
    attend = default if ours is None else ours.attend
    return attend(module, query, key, value, attention_mask, **kwargs)


def eagle_sdpa(module, query, key, value, attention_mask, eagle_pass: OurPass | None = None,
               eagle_query_positions: torch.Tensor | None = None, **kwargs):
    """Registered in place of ``"sdpa"``: transformers' SDPA attention, or what our pass asks for."""
    return _attend(sdpa_attention, module, query, key, value, attention_mask, eagle_pass, eagle_query_positions,
                   kwargs)


def eagle_eager(module, query, key, value, attention_mask, eagle_pass: OurPass | None = None,
                eagle_query_positions: torch.Tensor | None = None, **kwargs):
    """Registered in place of ``"eager"``: the model's own eager attention, or what our pass asks for."""
    return _attend(module_eager_attention, module, query, key, value, attention_mask, eagle_pass,
                   eagle_query_positions, kwargs)


TRANSFORMERS_TOUCHES = {
    "register": "transformers.AttentionInterface.register / AttentionMaskInterface.register",
    "select": "PretrainedConfig._attn_implementation_internal (set once, when a target is built)",
    "call_kwargs": "extra keyword arguments of a model call reach the attention function (TransformersKwargs)",
    "delegate": "transformers.integrations.sdpa_attention.sdpa_attention_forward",
    "module_eager": "<modeling module>.eager_attention_forward",
    "query_temperature": "Llama4TextAttention.attn_temperature_tuning / use_rope / floor_scale / attn_scale / "
                         "layer_idx; its forward's cache and hidden_states keyword arguments",
    "kernel": "the attention-function signature and keyword arguments, taken by "
              "eagle.kernels.attention.attention_forward",
}


def check_attention_implementation(model) -> None:
    """Refuse a model whose attention implementation ignores custom 4-D (tree) masks."""
    attention = getattr(model.config, "_attn_implementation", None)
    if base_attention(attention) not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"The base model uses attn_implementation={attention!r}, which ignores custom 4-D (tree) attention masks. "
            f"Load it with attn_implementation='sdpa' or 'eager'."
        )


def base_attention(implementation: str | None) -> str | None:
    """The model's own implementation behind ``implementation`` (ours name the one they stand in for)."""
    return next((own for own, ours in OUR_ATTENTION.items() if ours == implementation), implementation)


def register_our_attention() -> None:
    """Register :func:`eagle_sdpa` and :func:`eagle_eager` with transformers (once), with SDPA's and eager's own
    mask builders, so that a model call without our pass builds the masks and computes what it did before."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask, sdpa_mask

    for own, function, mask in (("sdpa", eagle_sdpa, sdpa_mask), ("eager", eagle_eager, eager_mask)):
        if OUR_ATTENTION[own] not in AttentionInterface():
            AttentionInterface.register(OUR_ATTENTION[own], function)
            AttentionMaskInterface.register(OUR_ATTENTION[own], mask)


def select_our_attention(config) -> str:
    """Name ours in ``config`` (a model's text config, SDPA or eager) in place of the model's own attention, once;
    returns the name. A config that names ours already is left as it is."""
    own = base_attention(getattr(config, "_attn_implementation_internal", None))
    if own not in SUPPORTED_ATTENTION:
        raise ValueError(f"Our attention stands in for 'sdpa' or 'eager' only, not {own!r}.")
    register_our_attention()
    config._attn_implementation_internal = OUR_ATTENTION[own]
    return OUR_ATTENTION[own]


def pass_attention(own: str, kernel: bool) -> Callable:
    """The attention function our passes run over a model whose own attention is ``own``: the position-ordered
    kernel with the GGUF kernels (``kernel``), else :func:`tree_sdpa_attention` for SDPA, the model's own eager
    attention for eager."""
    if kernel:
        from eagle.kernels.attention import attention_forward

        return attention_forward
    return tree_sdpa_attention if own == "sdpa" else module_eager_attention


class QueryTemperature:
    """The attention modules of a model whose queries are scaled by a temperature of the query position (Llama-4's
    NoPE layers: ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``). transformers computes the
    position from the cache length, which for a draft-tree node or a left-padded row is its cache slot, not its
    position. :meth:`take_over` moves the scaling into our attention functions, once: the module's own is switched
    off and a forward pre-hook gives our functions the positions of its queries (:data:`POSITIONS_ARGUMENT`):
    those of our pass, or those the module itself would have used."""

    def __init__(self, model):
        self.modules = [m for m in model.modules() if (getattr(m, "attn_temperature_tuning", False) is True
                                                       or isinstance(getattr(m, "eagle_temperature_hook", None),
                                                                     _QueryPositions))
                        and not getattr(m, "use_rope", True) and hasattr(m, "floor_scale")]

    def __bool__(self) -> bool:
        return bool(self.modules)

    def take_over(self) -> None:
        """Our attention functions apply the modules' temperature from now on (idempotent)."""
        for module in self.modules:
            if not isinstance(getattr(module, "eagle_temperature_hook", None), _QueryPositions):
                module.eagle_temperature_hook = _QueryPositions()
                module.register_forward_pre_hook(module.eagle_temperature_hook, with_kwargs=True)
                module.attn_temperature_tuning = False

    @staticmethod
    def scales(module, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, T) -> (B, 1, T, 1) float32 query scales, the formula of ``Llama4TextAttention``."""
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
        return scales.view(-1, 1, positions.shape[-1], 1)

    @staticmethod
    def apply(module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """query (B, heads, T, head_dim) scaled by its positions' temperature ((B, T) or (T,)), as transformers
        scales it: in float32, cast back."""
        return (query * QueryTemperature.scales(module, positions.to(query.device))).to(query.dtype)


class _QueryPositions:
    """The forward pre-hook of a module whose temperature our attention functions apply: it adds the positions of
    the module's queries to its keyword arguments, our pass's (:class:`OurPass`) or, in any other call, those the
    module computes itself (``arange(T)`` after its cache's length)."""

    def __call__(self, module, args, kwargs):
        ours = kwargs.get(PASS_ARGUMENT)
        if ours is not None and ours.positions is not None:
            positions = ours.positions
        else:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
            positions = torch.arange(hidden.shape[1], device=hidden.device) + past
        return args, {**kwargs, POSITIONS_ARGUMENT: positions}
