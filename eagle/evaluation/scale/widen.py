"""Function-preserving widening of a Llama-architecture model and of its EAGLE-3 head into a bigger shape of the
Llama, Qwen2 or Qwen2-MoE architecture (see Families below).

The widened model computes exactly the function of the source model (up to float rounding): its greedy tokens are
the source's, so an EAGLE head keeps its acceptance while every forward pass reads and multiplies the weights of
the bigger shape. The rules, for a source of hidden size ``h`` widened to ``H`` (``head_dim`` unchanged):

- Residual stream: its dims ``h..H-1`` stay zero for every token. The embedding's extra columns are zero; every
  matrix that writes into the residual (``o_proj``, ``down_proj``, the head's ``fc``) has zero rows there. The
  matrices that only read it (``q/k/v_proj``, ``gate/up_proj``, an untied ``lm_head``) hold small random values
  in the extra columns (they multiply zeros), with the standard deviation of the source tensor, so that memory
  traffic, compute and quantization blocks are those of a real model of the big shape.
- RMSNorm ``w * x * rsqrt(mean(x^2) + eps)`` over ``H`` dims of which ``h`` are nonzero: ``mean_H = (h / H)
  mean_h``, so with ``eps' = eps * h / H``, ``rsqrt(mean_H + eps') = sqrt(H / h) * rsqrt(mean_h + eps)`` and
  ``w' = w * sqrt(h / H)`` on the real dims gives the source's output exactly; the extra dims of ``w'`` are 1 (they
  scale zeros).
- Attention (grouped queries: query head ``i`` reads KV head ``i // g`` with ``g`` = query heads / KV heads): source
  KV head ``j`` becomes KV head ``j``, and source query head ``g0 * j + r`` (``r < g0``) becomes query head ``g * j
  + r``, so it still reads its own KV head; this needs ``g >= g0`` and at least as many KV heads. Every other head
  is extra: random ``q/k/v`` rows, zero ``o_proj`` columns (it adds nothing). RoPE is unchanged (same theta and
  ``head_dim``).
- MLP: extra intermediate units have random ``gate/up`` rows and zero ``down_proj`` columns.
- Extra layers are appended after the source's, so the layers an EAGLE-3 head reads keep their indices (the
  widened head's config names them, as the default ``[2, L // 2, L - 3]`` would move): random readers, zero
  ``o_proj`` and ``down_proj``, unit norms; each adds nothing to the residual.
- A tied LM head stays tied (it reads the final normed state, zero in the extra dims), except in a family whose
  llama.cpp architecture needs its own (``qwen2_moe``): a copy of the embedding, a reader like an untied head.

The EAGLE-3 head is widened to the target's new shape with the same rules (a real head of a big model has its
target's width): its residual is ``fc``'s output, so ``fc`` has zero rows in the extra dims and the source's
columns of each of the three target features at ``k * H .. k * H + h``; the decoder layer's ``q/k/v`` read
``cat(embedding, hidden)`` of ``2 H`` dims, the source's columns at ``0..h`` and ``H..H + h``. Its hidden size then
equals the target's, so it ships no embedding and uses the widened target's (zero extra columns), as the source head
does. ``d2t``/``t2d`` are unchanged.

Families (``FAMILIES``): the widened model can be written as another architecture that holds the same function.

- ``llama``: ``LlamaForCausalLM`` (the source's own).
- ``qwen2``: ``Qwen2ForCausalLM``, which adds ``q/k/v`` biases. Rows a real query head computes or a real KV head
  holds (a real KV head is shared by real and extra query heads) get zero bias; the extra heads' rows, whose outputs
  ``o_proj`` drops, get small random biases, so a bias is read and added as in a real Qwen2.
- ``qwen2_moe``: ``Qwen2MoeForCausalLM``, every layer a mixture of experts (softmax top-k routing without
  renormalisation, ``norm_topk_prob`` false as llama.cpp's ``qwen2moe`` computes it, plus a shared expert under a
  sigmoid gate). The source's MLP becomes the shared expert widened to ``intermediate_size`` with its ``down_proj``
  doubled, and ``shared_expert_gate`` is zero: ``sigmoid(0) * 2 = 1`` exactly (a power of two). Routed experts have
  random ``gate/up`` rows and an all-zero ``down_proj`` (rows in the real dims would change the output, rows in the
  extra dims would break the residual's zero extra dims that the RMSNorm rule needs), so they add nothing yet are
  read as a real MoE's are; the router is random over every dim, so the experts chosen depend on the token and
  ``k`` verified tokens touch different experts. transformers reads no expert widths from a ``qwen2moe`` GGUF (it
  keeps ``moe_intermediate_size`` 1408 and ``shared_expert_intermediate_size`` 5632), so the shapes meant for a GGUF
  use those widths.
- Qwen3 cannot carry the source's function: its per-head q/k RMSNorms read ``rms_norm_eps`` too, and with the
  residual's epsilon scaled by ``h / H`` (above) they cannot be made the identity on every input, so a Qwen3 shape
  would compute a different function and an EAGLE head trained on the source would not keep its acceptance. No
  ``qwen3`` family is offered, not even as a shape for costs alone: transformers reads no head size from a Qwen3
  GGUF (it keeps Qwen3's 128), so a shape with the source's heads of 64 would not load from its GGUF here.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch


#: the architectures a widened model is written as (see Families in the module docstring)
FAMILIES = ("llama", "qwen2", "qwen2_moe")
#: families whose llama.cpp architecture requires an LM head of its own (``output.weight``): a tied source's is
#: written as a copy of the widened embedding's real columns
UNTIED_FAMILIES = ("qwen2_moe",)


@dataclass(frozen=True)
class Shape:
    """A shape to widen into (``head_dim`` must be the source's). ``experts`` > 0: a mixture of experts (family
    ``qwen2_moe``) of ``experts`` routed experts of ``expert_size`` units, ``experts_per_token`` chosen per token, and
    a shared expert of ``intermediate_size`` units."""

    name: str
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_hidden_layers: int
    head_dim: int = 64
    experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0

    @classmethod
    def of_config(cls, config, name: str = "source") -> "Shape":
        """The shape of a transformers Llama config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(name, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                   config.intermediate_size, config.num_hidden_layers, head_dim)

    @property
    def group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


# Shapes SmolLM2-135M (hidden 576, 9 query / 3 KV heads of 64, intermediate 1536, 30 layers) widens into.
SHAPES = {
    # small enough for tests: 12 query / 3 KV heads (group 4 instead of 3), one extra layer (~210M parameters)
    "tiny": Shape("tiny", 768, 12, 3, 1792, 31),
    # ~1.9B parameters: SmolLM2-1.7B's width (hidden 2048, intermediate 8192, 32 heads of 64) with Llama 3.2's
    # 8 KV heads, 30 layers
    "2b": Shape("2b", 2048, 32, 8, 8192, 30),
    # Llama 3.1 8B's shape (hidden 4096, 32 layers, intermediate 14336) with heads of 64: 64 query / 16 KV heads;
    # ~7.2B parameters with SmolLM2's 49152-token tied vocabulary
    "8b": Shape("8b", 4096, 64, 16, 14336, 32),
    # Qwen2-MoE (family qwen2_moe), ~2.07B parameters (1.99B in the layers) of which ~0.90B are read per token:
    # hidden 768, 12 query / 3 KV heads of 64, 30 layers (the source's), each 16 routed experts of 1408 units
    # (top-4) and a shared expert of 5632 (Qwen1.5-MoE-A2.7B's expert widths, which transformers assumes for a
    # qwen2moe GGUF), an untied LM head
    "moe-2b": Shape("moe-2b", 768, 12, 3, 5632, 30, experts=16, experts_per_token=4, expert_size=1408),
}


def check_family(shape: Shape, family: str) -> None:
    """Raise a ValueError unless ``family`` is one of :data:`FAMILIES` and ``shape`` is of its kind (a mixture of
    experts exactly for ``qwen2_moe``)."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}; expected one of {', '.join(FAMILIES)}.")
    if (family == "qwen2_moe") != (shape.experts > 0):
        kind = "a mixture-of-experts shape (experts > 0)" if family == "qwen2_moe" else "a dense shape (experts 0)"
        raise ValueError(f"The shape {shape.name!r} has {shape.experts} experts, but the family {family!r} needs "
                         f"{kind}.")
    if shape.experts and not (0 < shape.experts_per_token <= shape.experts and shape.expert_size > 0):
        raise ValueError(f"The shape {shape.name!r} chooses {shape.experts_per_token} of {shape.experts} experts of "
                         f"{shape.expert_size} units; expected 1..experts chosen and at least one unit.")


def check_widening(source: Shape, shape: Shape) -> None:
    """Raise a ValueError naming the first field of ``shape`` that cannot hold ``source`` function-preservingly."""
    name = f"The shape {shape.name!r}"
    if shape.head_dim != source.head_dim:
        raise ValueError(f"{name} has head_dim {shape.head_dim}, but widening keeps the source's head_dim "
                         f"{source.head_dim}.")
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_key_value_heads"):
        if getattr(shape, field) < getattr(source, field):
            raise ValueError(f"{name} has {field} {getattr(shape, field)}, fewer than the source's "
                             f"{getattr(source, field)}; a widening needs at least as many.")
    if shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(f"{name} has {shape.num_attention_heads} query heads, not a multiple of its "
                         f"{shape.num_key_value_heads} KV heads.")
    if shape.hidden_size % shape.num_attention_heads:
        raise ValueError(f"{name} has hidden_size {shape.hidden_size}, not a multiple of its "
                         f"{shape.num_attention_heads} query heads (transformers' Llama config requires it).")
    if shape.group < source.group:
        raise ValueError(f"{name} groups {shape.group} query heads per KV head, fewer than the source's "
                         f"{source.group}: each source KV head's {source.group} query heads must share one KV head.")


def query_head_positions(source: Shape, shape: Shape) -> list[int]:
    """The new index of each source query head: ``g0 * j + r`` -> ``g * j + r`` (see the module docstring)."""
    return [shape.group * (i // source.group) + i % source.group for i in range(source.num_attention_heads)]


def unit_index(positions: list[int], width: int) -> torch.Tensor:
    """Rows (or columns) of units of ``width`` (heads of head_dim) placed at ``positions``."""
    return torch.cat([torch.arange(p * width, (p + 1) * width) for p in positions])


class Widener:
    """Builds widened tensors one at a time from source tensors (float32), deterministic for a seed."""

    def __init__(self, source: Shape, shape: Shape, seed: int = 0, dtype: torch.dtype = torch.float32,
                 origin: str = "the source", family: str = "llama"):
        check_widening(source, shape)
        check_family(shape, family)
        self.source, self.shape, self.seed, self.dtype, self.family = source, shape, seed, dtype, family
        self.biases = family in ("qwen2", "qwen2_moe")  # q/k/v biases
        self.origin = origin  # named in errors: the file or directory the source tensors come from
        hd = source.head_dim
        self.q_rows = unit_index(query_head_positions(source, shape), hd)
        self.kv_rows = torch.arange(source.num_key_value_heads * hd)
        self.real = torch.arange(source.hidden_size)
        self.units = torch.arange(source.intermediate_size)

    def random(self, name: str, size: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """Normal values with ``like``'s standard deviation, seeded by the tensor's name."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        std = float(like.float().std()) if like.numel() > 1 else 0.02
        return torch.randn(size, generator=generator) * (std or 0.02)

    def matrix(self, name: str, src: torch.Tensor, size: tuple[int, int], rows: torch.Tensor, cols: torch.Tensor,
               reader: bool, zero_rows_from: int | None = None) -> torch.Tensor:
        """``size`` with ``src`` at (``rows``, ``cols``); elsewhere random (``reader``) or zero; rows from
        ``zero_rows_from`` on zero (they would write into the residual's extra dims)."""
        if tuple(src.shape) != (len(rows), len(cols)):
            raise ValueError(f"Tensor {name} of {self.origin} has shape {tuple(src.shape)}, but its config implies "
                             f"{(len(rows), len(cols))}.")
        out = self.random(name, size, src) if reader else torch.zeros(size)
        if zero_rows_from is not None:
            out[zero_rows_from:] = 0
        out[rows[:, None], cols[None, :]] = src.float()
        return out.to(self.dtype)

    def norm(self, src: torch.Tensor | None) -> torch.Tensor:
        """An RMSNorm weight over the widened hidden size: ``w * sqrt(h / H)`` on the real dims, 1 elsewhere; an
        extra layer's (``src`` None) is all ones."""
        out = torch.ones(self.shape.hidden_size)
        if src is not None:
            out[: self.source.hidden_size] = src.float() * math.sqrt(self.source.hidden_size / self.shape.hidden_size)
        return out.to(self.dtype)

    def eps(self, eps: float) -> float:
        """The RMSNorm epsilon over the widened hidden size."""
        return eps * self.source.hidden_size / self.shape.hidden_size

    def sizes(self, input_size: int | None = None) -> dict[str, tuple[int, int]]:
        s = self.shape
        inp = input_size or s.hidden_size
        return {"q_proj": (s.num_attention_heads * s.head_dim, inp),
                "k_proj": (s.num_key_value_heads * s.head_dim, inp),
                "v_proj": (s.num_key_value_heads * s.head_dim, inp),
                "o_proj": (s.hidden_size, s.num_attention_heads * s.head_dim),
                "gate_proj": (s.intermediate_size, s.hidden_size), "up_proj": (s.intermediate_size, s.hidden_size),
                "down_proj": (s.hidden_size, s.intermediate_size)}

    def attention(self, prefix: str, src: Mapping[str, torch.Tensor], input_cols: torch.Tensor,
                  extra: bool = False, input_size: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``q/k/v/o_proj`` of one layer (``prefix`` ends with ``self_attn.``); ``input_cols``: the source's input
        columns in the widened input; ``extra``: a layer the source lacks (``src`` gives only the scales)."""
        sizes = self.sizes(input_size)
        for proj, rows in (("q_proj", self.q_rows), ("k_proj", self.kv_rows), ("v_proj", self.kv_rows)):
            name, weight = f"{prefix}{proj}.weight", src[f"{prefix}{proj}.weight"]
            yield name, (self.random(name, sizes[proj], weight).to(self.dtype) if extra
                         else self.matrix(name, weight, sizes[proj], rows, input_cols, reader=True))
        if self.biases:
            for proj, rows in (("q_proj", self.q_rows), ("k_proj", self.kv_rows), ("v_proj", self.kv_rows)):
                yield f"{prefix}{proj}.bias", self.bias(f"{prefix}{proj}.bias", sizes[proj][0],
                                                        torch.arange(0) if extra else rows)
        name = f"{prefix}o_proj.weight"
        yield name, (torch.zeros(sizes["o_proj"], dtype=self.dtype) if extra
                     else self.matrix(name, src[name], sizes["o_proj"], self.real, self.q_rows, reader=False))

    def bias(self, name: str, size: int, real_rows: torch.Tensor) -> torch.Tensor:
        """A q/k/v bias: zero on ``real_rows`` (what real query heads compute or read), small random values on the
        extra heads' rows (their outputs are dropped by ``o_proj``)."""
        out = self.random(name, (1, size), torch.zeros(0))[0]
        out[real_rows] = 0
        return out.to(self.dtype)

    def tensors_per_layer(self) -> int:
        """How many tensors :func:`widened_model_tensors` writes per decoder layer."""
        mlp = 7 if self.shape.experts else 3  # router, 2 stacked expert tensors, shared expert (3), its gate
        return 2 + 4 + (3 if self.biases else 0) + mlp

    def moe(self, prefix: str, src: Mapping[str, torch.Tensor], extra: bool = False
            ) -> Iterator[tuple[str, torch.Tensor]]:
        """A Qwen2-MoE layer's MLP (``prefix`` ends with ``mlp.``) from the source's dense MLP ``src`` (names
        ``{prefix}gate_proj.weight`` ...): the shared expert holds it with ``down_proj`` doubled under a zero gate;
        the routed experts and the router are random readers, the experts' ``down_proj`` zero."""
        s, like = self.shape, src[f"{prefix}gate_proj.weight"]
        name = f"{prefix}gate.weight"
        yield name, self.random(name, (s.experts, s.hidden_size), like).to(self.dtype)
        name = f"{prefix}experts.gate_up_proj"
        yield name, self.random(name, (s.experts * 2 * s.expert_size, s.hidden_size), like).view(
            s.experts, 2 * s.expert_size, s.hidden_size).to(self.dtype)
        yield f"{prefix}experts.down_proj", torch.zeros((s.experts, s.hidden_size, s.expert_size), dtype=self.dtype)
        shared = {name.replace(prefix, f"{prefix}shared_expert."): tensor for name, tensor in src.items()}
        for name, tensor in self.mlp(f"{prefix}shared_expert.", shared, extra=extra):
            yield name, tensor * 2 if name.endswith("down_proj.weight") else tensor
        yield f"{prefix}shared_expert_gate.weight", torch.zeros((1, s.hidden_size), dtype=self.dtype)

    def mlp(self, prefix: str, src: Mapping[str, torch.Tensor], extra: bool = False
            ) -> Iterator[tuple[str, torch.Tensor]]:
        """``gate/up/down_proj`` of one layer (``prefix`` ends with ``mlp.``)."""
        sizes = self.sizes()
        for proj in ("gate_proj", "up_proj"):
            name, weight = f"{prefix}{proj}.weight", src[f"{prefix}{proj}.weight"]
            yield name, (self.random(name, sizes[proj], weight).to(self.dtype) if extra
                         else self.matrix(name, weight, sizes[proj], self.units, self.real, reader=True))
        name = f"{prefix}down_proj.weight"
        yield name, (torch.zeros(sizes["down_proj"], dtype=self.dtype) if extra
                     else self.matrix(name, src[name], sizes["down_proj"], self.real, self.units, reader=False))


def widened_model_tensors(state: Mapping[str, torch.Tensor], widener: Widener, tied: bool
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """The widened model's tensors (transformers' names of the widener's family), one at a time, from the source's
    ``state``."""
    src, shape = widener.source, widener.shape
    embedding = state["model.embed_tokens.weight"]
    yield "model.embed_tokens.weight", widener.matrix(
        "model.embed_tokens.weight", embedding, (embedding.shape[0], shape.hidden_size),
        torch.arange(embedding.shape[0]), widener.real, reader=False)
    for layer in range(shape.num_hidden_layers):
        extra = layer >= src.num_hidden_layers
        source_prefix = f"model.layers.{min(layer, src.num_hidden_layers - 1)}."
        prefix = f"model.layers.{layer}."
        view = {name.replace(source_prefix, prefix): tensor for name, tensor in state.items()
                if name.startswith(source_prefix)}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}{norm}.weight", widener.norm(None if extra else view[f"{prefix}{norm}.weight"])
        yield from widener.attention(f"{prefix}self_attn.", view, widener.real, extra=extra)
        yield from (widener.moe if shape.experts else widener.mlp)(f"{prefix}mlp.", view, extra=extra)
    yield "model.norm.weight", widener.norm(state["model.norm.weight"])
    if not tied or widener.family in UNTIED_FAMILIES:
        head = state["lm_head.weight"] if "lm_head.weight" in state else embedding
        yield "lm_head.weight", widener.matrix("lm_head.weight", head, (head.shape[0], shape.hidden_size),
                                               torch.arange(head.shape[0]), widener.real, reader=True)


HEAD_LAYER_TENSORS = {f"midlayer.{name}.weight" for name in (
    "hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def widened_head_tensors(state: Mapping[str, torch.Tensor], widener: Widener) -> Iterator[tuple[str, torch.Tensor]]:
    """The widened EAGLE-3 head's tensors (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), from a
    source head of the source target's width whose state has no embedding (it uses the target's)."""
    h, H = widener.source.hidden_size, widener.shape.hidden_size
    known = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | HEAD_LAYER_TENSORS
    unknown = sorted(k for k in state if k not in known)
    missing = sorted(k for k in known - {"d2t", "t2d"} if k not in state)
    if unknown or missing:
        raise ValueError(f"The EAGLE-3 head {widener.origin} has tensors a widening does not handle "
                         f"({', '.join(unknown) or 'none'}) or lacks some ({', '.join(missing) or 'none'}); expected "
                         "one decoder layer `midlayer.*` without biases, `fc`, `norm`, `lm_head`, `d2t`, `t2d`.")
    fc = state["fc.weight"]
    features = torch.cat([k * H + torch.arange(h) for k in range(3)])
    yield "fc.weight", widener.matrix("fc.weight", fc, (H, 3 * H), widener.real, features, reader=True,
                                      zero_rows_from=h)
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        yield f"midlayer.{norm}.weight", widener.norm(state[f"midlayer.{norm}.weight"])
    both = torch.cat([torch.arange(h), H + torch.arange(h)])  # cat(embedding, hidden): embedding first
    yield from widener.attention("midlayer.self_attn.", state, both, input_size=2 * H)
    yield from widener.mlp("midlayer.mlp.", state)
    yield "norm.weight", widener.norm(state["norm.weight"])
    head = state["lm_head.weight"]
    yield "lm_head.weight", widener.matrix("lm_head.weight", head, (head.shape[0], H), torch.arange(head.shape[0]),
                                           widener.real, reader=True)
    for name in ("d2t", "t2d"):
        if name in state:
            yield name, state[name]
