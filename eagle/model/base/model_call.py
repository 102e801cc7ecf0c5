"""How the engine calls a target model's forward: transformers 5's signature, or the transformers 4 one that remote
code (run only when the caller passes ``trust_remote_code``; MiniCPM4's ``modeling_minicpm.py``) is written for.

The engine always calls ``model(input_ids=..., attention_mask=<4-D additive mask>, position_ids=..., cache=<our
TreeKVCache>, use_cache=True, output_hidden_states=..., logits_to_keep=...)``. A transformers 4 style forward takes
the cache as ``past_key_values`` and may take no ``logits_to_keep`` (``num_logits_to_keep`` in 4.45 - 4.49, nothing
before): :class:`ModelCall` passes the cache under the name the forward takes and, when it cannot keep logits
itself, keeps the asked-for positions of the full logits, so callers see the same output either way. Our cache is
a transformers ``Cache`` with the 4.x methods such code calls (``update``, ``get_seq_length``,
``get_usable_length``).

How such code reads a 4-D mask is its own business (transformers 4 changed it between releases), so a model called
the 4.x way is checked once, numerically, before it serves (:func:`check_tree_attention`): a prompt and a small tree
through the engine's cache and masks must give the logits the model computes for each path alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

#: Names a forward may give the cache, transformers 5's first.
CACHE_ARGUMENTS = ("cache", "past_key_values")
#: Names a forward may give logits_to_keep, transformers 5's first.
KEEP_ARGUMENTS = ("logits_to_keep", "num_logits_to_keep")


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # (B, T', V): the kept positions
    hidden_states: tuple | None  # output_hidden_states: input of each layer, then the final normed state


def keep_logits(logits: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """transformers' ``logits_to_keep`` applied to full logits (B, T, V): an int k keeps the last k positions
    (0: all), a 1-D tensor the positions it lists."""
    if isinstance(logits_to_keep, int):
        return logits if logits_to_keep == 0 else logits[:, -logits_to_keep:]
    return logits[:, logits_to_keep.to(logits.device)]


class ModelCall:
    """The forward signature of ``model``: under which name it takes the cache and ``logits_to_keep``."""

    def __init__(self, model):
        parameters = inspect.signature(model.forward).parameters
        named = [name for name in CACHE_ARGUMENTS if name in parameters]
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        if not named and not takes_any:
            raise ValueError(f"{type(model).__name__}.forward takes neither `cache` (transformers 5) nor "
                             "`past_key_values` (transformers 4): the engine cannot give it a KV cache.")
        self.cache_argument = named[0] if named else "cache"
        self.keep_argument = next((name for name in KEEP_ARGUMENTS if name in parameters), None)
        self.returns_dict = "return_dict" in parameters
        self.takes_extra = takes_any  # more keyword arguments (transformers 5 passes them down to the attention)

    @property
    def legacy(self) -> bool:
        """Whether the forward is written for transformers 4's cache API."""
        return self.cache_argument != "cache"

    def __call__(self, model, *, input_ids, attention_mask, position_ids, cache, output_hidden_states,
                 logits_to_keep=0, extra: dict | None = None) -> ForwardOutput:
        """One forward pass; ``logits_to_keep`` as transformers 5 takes it (int or 1-D tensor of positions);
        ``extra``: more keyword arguments for the model (transformers passes them down to the attention
        function)."""
        kwargs = {**(extra or {}), self.cache_argument: cache}
        if self.keep_argument is not None:
            kwargs[self.keep_argument] = logits_to_keep
        if self.returns_dict:
            kwargs["return_dict"] = True
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=cache is not None, output_hidden_states=output_hidden_states, **kwargs)
        logits = outputs.logits if self.keep_argument is not None else keep_logits(outputs.logits, logits_to_keep)
        return ForwardOutput(logits, getattr(outputs, "hidden_states", None))


def _probe_tokens(vocab_size: int, count: int) -> list[int]:
    """``count`` distinct token ids of a vocabulary, away from the first few (special) ids where possible."""
    start = 3 if vocab_size > count + 3 else 0
    return [start + (7 * i) % (vocab_size - start) for i in range(count)]


@torch.no_grad()
def check_tree_attention(target) -> float:
    """Run a 4-token prompt, then a 3-node tree (a root and two children of it) after it, through ``target`` with
    the engine's cache and masks, and compare each node's logits with the model's own for that path alone (no
    cache, no mask). Returns the largest difference relative to the logits' scale; ``ValueError`` when it is beyond
    rounding (the model reads the 4-D mask in another convention, ignores it, or takes positions from elsewhere)."""
    tokens = _probe_tokens(target.config.vocab_size, 7)
    prompt, (root, left, right) = tokens[:4], tokens[4:]
    cache = target.new_cache(len(prompt) + 3)
    first = target.prefill(torch.tensor([prompt]), cache, features=False)
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    nodes = target.verify(torch.tensor([[root, left, right]]), cache, torch.tensor([4, 5, 5]), tree, features=False)
    paths = [prompt, prompt + [root], prompt + [root, left], prompt + [root, right]]
    alone = [target.call(target.model, input_ids=torch.tensor([p], device=target.device), attention_mask=None,
                         position_ids=None, cache=None, output_hidden_states=False, logits_to_keep=1).logits[0, -1]
             for p in paths]
    ours = [first.logits[0, -1]] + [nodes.logits[0, i] for i in range(3)]
    worst = max(float((a.float() - b.float()).abs().max()) / max(1.0, float(a.float().abs().max()))
                for a, b in zip(alone, ours))
    tolerance = 1e-3 if target.dtype == torch.float32 else 5e-2
    if worst > tolerance:
        raise ValueError(
            f"{type(target.model).__name__} (a forward written for transformers 4, taking `past_key_values`) does not "
            f"compute under the engine's 4-D tree mask and cache what it computes for each path alone (logits differ "
            f"by {worst:.3g} of their scale): its code reads the 4-D mask in another convention, ignores it, or takes "
            "positions from elsewhere, so EAGLE cannot serve it losslessly. Pass allow_unknown_attention=True to run "
            "it anyway (its output may then differ from plain decoding).")
    return worst
