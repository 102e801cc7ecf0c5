"""What the trainer needs from the frozen target for a batch: the EAGLE-3 features and the target's
distribution over the draft vocabulary, computed in the loop under no_grad, or kept from the first epoch
(``--cache_target``) so that later epochs skip the target entirely.

The cache keeps, per sample (in memory, and in ``cache_dir`` when given, so a restarted run reuses it), the
features in half precision and the ``top_k`` most probable draft tokens of
the target's distribution (renormalised over them). That is what makes training on a CPU affordable: the
target's forward pass is a large part of each step, and it is the same in every epoch. On GPUs the forward pass
is cheap and the cache is not needed.
"""

from __future__ import annotations

import os

import torch

from .frozen_target import target_features
from .ttt import target_distribution


def sparsify(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., Vd) distribution -> the ``top_k`` largest entries: ids (..., k) int32 and renormalised probabilities
    (..., k) float32."""
    values, ids = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    return ids.to(torch.int32), values / values.sum(-1, keepdim=True)


def densify(ids: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of :func:`sparsify` (the dropped entries are zero): (..., k) -> (..., size) float32."""
    dense = torch.zeros(*ids.shape[:-1], size, dtype=torch.float32, device=ids.device)
    return dense.scatter_(-1, ids.long(), values.float())


class TargetOutputs:
    """Features (B, S, F), draft-vocabulary target distribution (B, S, Vd) and whether the target's top token is
    in the draft vocabulary (B, S), for one batch, from the target or from the cache."""

    def __init__(self, target, head, layer_ids: list[int], cache_top_k: int | None = None, feature_dtype=torch.float16,
                 cache_dir: str | None = None):
        self.target = target
        self.cache_dir = cache_dir
        self.head = head
        self.layer_ids = layer_ids
        self.cache_top_k = cache_top_k
        self.feature_dtype = feature_dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def caching(self) -> bool:
        return self.cache_top_k is not None

    def cached_tokens(self) -> int:
        return sum(entry[0].shape[0] for entry in self._cache.values())

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        indices = batch["index"].tolist()
        if self.caching and all(self._lookup(index) for index in indices):
            return self._from_cache(indices, batch["input_ids"].shape[1], device)
        input_ids = batch["input_ids"].to(device)
        attention_mask = batch["attention_mask"].to(device)
        features, logits = target_features(self.target, input_ids, attention_mask, self.layer_ids)
        probs, in_draft = target_distribution(logits, self.head)
        del logits
        if not self.caching:
            return features, probs, in_draft
        lengths = attention_mask.sum(-1).tolist()
        ids, values = sparsify(probs, self.cache_top_k)
        for row, (index, length) in enumerate(zip(indices, lengths)):
            feature = features[row, :length]
            # float16 keeps more precision than bfloat16 but overflows past 65504: use it only when the values fit.
            dtype = self.feature_dtype if float(feature.abs().max()) < 60000 else torch.bfloat16
            self._cache[index] = (
                feature.to("cpu", dtype),
                ids[row, :length].cpu(),
                values[row, :length].to("cpu", torch.float16),
                in_draft[row, :length].cpu(),
            )
            self._save(index)
        # Train on exactly what later epochs will read back.
        return self._from_cache(indices, input_ids.shape[1], device)

    def _path(self, index: int) -> str:
        return os.path.join(self.cache_dir, f"{index}.safetensors")

    def _lookup(self, index: int) -> bool:
        """Whether sample ``index`` is cached (reading it from disk into memory when it is only there)."""
        if index in self._cache:
            return True
        if self.cache_dir is None or not os.path.isfile(self._path(index)):
            return False
        from safetensors.torch import load_file

        stored = load_file(self._path(index))
        self._cache[index] = (stored["features"], stored["ids"], stored["values"], stored["in_draft"].bool())
        return True

    def _save(self, index: int) -> None:
        if self.cache_dir is None:
            return
        from safetensors.torch import save_file

        os.makedirs(self.cache_dir, exist_ok=True)
        features, ids, values, in_draft = self._cache[index]
        tmp = self._path(index) + f".tmp{os.getpid()}"
        save_file({"features": features, "ids": ids, "values": values, "in_draft": in_draft.to(torch.uint8)}, tmp)
        os.replace(tmp, self._path(index))

    def _from_cache(self, indices: list[int], width: int, device):
        entries = [self._cache[index] for index in indices]
        feature_size = entries[0][0].shape[-1]
        draft_vocab = self.head.draft_vocab_size if self.head.reduced_vocab else self.head.vocab_size
        bsz = len(entries)
        features = torch.zeros(bsz, width, feature_size, dtype=torch.float32)
        probs = torch.zeros(bsz, width, draft_vocab, dtype=torch.float32)
        in_draft = torch.zeros(bsz, width, dtype=torch.bool)
        for row, (feat, ids, values, flags) in enumerate(entries):
            length = feat.shape[0]
            features[row, :length] = feat.float()
            probs[row, :length] = densify(ids, values, draft_vocab)
            in_draft[row, :length] = flags
        return features.to(device), probs.to(device), in_draft.to(device)
