"""A GGUF mixture-of-experts MLP's router and experts over the file's blocks.

transformers holds a Qwen2-MoE / Qwen3-MoE layer's experts as two stacked float32 parameters of an experts module
(``gate_up_proj`` (E, 2I, H), gate rows first, and ``down_proj`` (E, H, I)) and its router as a plain (E, H)
parameter, none of them an ``nn.Linear``, so the linear-layer conversion leaves them float32. A GGUF file stores
them as ``blk.N.ffn_{gate,up,down}_exps`` (E, out, in) and ``blk.N.ffn_gate_inp``: each expert's 2-D slice is an
ordinary matrix of the tensor's type. :func:`convert_gguf_experts` replaces the experts module with
:class:`KernelExperts` (per expert one kernel weight of its gate and up rows and one of its down rows, each expert's
rows of blocks sliced from the stacked tensors) and the router with :class:`KernelRouter` (its logits on
the kernels). Both compute what transformers' modules compute, in the same order:

* router: ``logits = x W_r``; ``p = softmax(logits)`` in float32; the top-k of ``p`` (``torch.topk``: the same
  order and ties); renormalised to sum 1 where the model sets ``norm_topk_prob``;
* experts: for every expert some row selected, in ascending expert order, ``(act(x W_gate) * (x W_up)) W_down``
  of those rows times their routing weight, added into a zero row (``index_add_``): each row's sum is its own
  experts' terms in ascending expert order, whatever other rows the call holds (row-invariant, like the kernels).

The products run on the kernels, so the MLP's output agrees with transformers' float32 model to float32 rounding
(the kernels' sums are in their own order), not bit for bit.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from eagle.kernels.gguf_weights import GGUFWeight
from eagle.kernels.linear import QuantLinear, kernel_handles

logger = logging.getLogger(__name__)

#: transformers' router classes whose routing :class:`KernelRouter` computes (softmax, top-k, optional renorm).
SOFTMAX_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts")


def expert_slice(weight: GGUFWeight, expert: int) -> GGUFWeight:
    """Expert ``expert``'s (out, in) matrix of a stacked (E, out, in) GGUF tensor: its rows of blocks."""
    if len(weight.shape) != 3 or not 0 <= expert < weight.shape[0]:
        raise ValueError(f"expert_slice({weight.name!r}): expected a 3-D (experts, out, in) tensor and an expert "
                         f"index below its first size, got shape {weight.shape} and expert {expert}")
    rows = weight.shape[1]
    return GGUFWeight(f"{weight.name}[{expert}]", weight.type_name, tuple(weight.shape[1:]),
                      weight.blocks[expert * rows:(expert + 1) * rows])


class KernelRouter(nn.Module):
    """A softmax top-k router (:data:`SOFTMAX_ROUTERS`) with its logits on the kernels; returns what the router it
    replaces returns: (logits, the top-k weights, the top-k expert indices)."""

    def __init__(self, router: nn.Module, linear: QuantLinear):
        super().__init__()
        self.top_k, self.num_experts = router.top_k, router.num_experts
        self.norm_topk_prob, self.hidden_dim = bool(router.norm_topk_prob), router.hidden_dim
        self.linear = linear

    def forward(self, hidden_states: torch.Tensor):
        logits = self.linear(hidden_states.reshape(-1, self.hidden_dim))
        probabilities = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top_weights, top_experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights /= top_weights.sum(dim=-1, keepdim=True)
        return logits, top_weights.to(logits.dtype), top_experts


class KernelExperts(nn.Module):
    """The experts of a mixture-of-experts MLP on the kernels: ``gate_up[e]`` (gate rows, then up rows) and
    ``down[e]`` per expert; called as transformers' experts module is (rows, top-k indices, top-k weights)."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear], act_fn: nn.Module):
        super().__init__()
        self.gate_up, self.down, self.act_fn = nn.ModuleList(gate_up), nn.ModuleList(down), act_fn
        self.num_experts = len(gate_up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():  # ascending, as transformers' loop visits them
            if not 0 <= expert < self.num_experts:
                continue
            rows, slots = torch.where(top_k_index == expert)
            gate, up = self.gate_up[expert](hidden_states[rows]).chunk(2, dim=-1)
            output = self.down[expert](self.act_fn(gate) * up) * top_k_weights[rows, slots, None]
            out.index_add_(0, rows, output.to(out.dtype))
        return out


def _expert_layers(experts: nn.Module, stacked: dict, numerics: str) -> tuple[list, list]:
    gate, up, down = stacked["gate"], stacked["up"], stacked["down"]
    gate_up, downs = [], []
    for expert in range(experts.num_experts):
        fused = GGUFWeight.concat_rows([expert_slice(gate, expert), expert_slice(up, expert)],
                                       f"{gate.name}+up[{expert}]")
        gate_up.append(QuantLinear(fused, None, numerics))
        downs.append(QuantLinear(expert_slice(down, expert), None, numerics))
    return gate_up, downs


def _stacked(weights, index: int) -> dict | None:
    stacked = {kind: weights.get(f"blk.{index}.ffn_{kind}_exps.weight") for kind in ("gate", "up", "down")}
    if any(w is None or not kernel_handles(w.type_name) or len(w.shape) != 3 for w in stacked.values()):
        return None
    return stacked


def convert_gguf_experts(model: nn.Module, weights, names: dict, numerics: str, check_equal) -> int:
    """Replace, in place, each ``model.layers.N.mlp.experts`` module whose stacked GGUF tensors the kernels handle
    with a :class:`KernelExperts`, and its layer's softmax router with a :class:`KernelRouter`; ``check_equal(quant,
    dense, name)`` checks a replaced weight against transformers' float32 one. Returns how many modules changed."""
    count = 0
    for name, experts in list(model.named_modules()):
        match = _EXPERTS.fullmatch(name)
        if match is None or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
            continue
        stacked = _stacked(weights, int(match.group(1)))
        if stacked is None:
            logger.warning("GGUF kernels: %s stays float32 (no stacked expert tensors the kernels handle).", name)
            continue
        gate_up, down = _expert_layers(experts, stacked, numerics)
        for expert in range(experts.num_experts):
            check_equal(gate_up[expert], experts.gate_up_proj[expert], f"{stacked['gate'].name}[{expert}]")
            check_equal(down[expert], experts.down_proj[expert], f"{stacked['down'].name}[{expert}]")
        mlp = model.get_submodule(name.rpartition(".")[0])
        mlp.experts = KernelExperts(gate_up, down, experts.act_fn)
        count += 1 + _convert_router(mlp, weights, names, name.rpartition(".")[0], numerics, check_equal)
    return count


def _convert_router(mlp: nn.Module, weights, names: dict, mlp_name: str, numerics: str, check_equal) -> int:
    router = getattr(mlp, "gate", None)
    if type(router).__name__ not in SOFTMAX_ROUTERS:
        return 0
    weight = weights.get(names.get(f"{mlp_name}.gate.weight"))
    if weight is None or not kernel_handles(weight.type_name) or len(weight.shape) != 2:
        logger.warning("GGUF kernels: the router %s.gate stays float32.", mlp_name)
        return 0
    linear = QuantLinear(weight, None, numerics)
    check_equal(linear, router.weight, weight.name)
    mlp.gate = KernelRouter(router, linear)
    return 1
