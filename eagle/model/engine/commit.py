"""Commit: after verification each row keeps the KV entries of its accepted path, right after its own committed
tokens, and rows that finished leave the batch.

All rows share the cache's slot axis: every forward pass writes every row at the same slots, and row b's committed
tokens sit at slots ``start[b] .. length[b] - 1`` (:class:`Rows`); its RoPE positions count from its first real
token, so each row computes what its prompt alone would (the pad slots and a row's leftovers past its own length are
masked out, never attended).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rows:
    """Where the rows still generating sit in the shared cache: ``index`` their numbers in the caller's batch; row
    i's committed tokens at slots ``start[i] .. length[i] - 1``."""

    index: list[int]
    start: list[int]
    length: list[int]

    def select(self, keep: list[int]) -> "Rows":
        return Rows([self.index[i] for i in keep], [self.start[i] for i in keep], [self.length[i] for i in keep])

    def masks(self, slots: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(valid (B, slots) bool, key positions (B, slots)) of the first ``slots`` cache slots; (None, None) when
        every row holds exactly those slots from position 0 (a batch of one)."""
        if all(s == 0 for s in self.start) and all(n == slots for n in self.length):
            return None, None
        ids = torch.arange(slots, device=device)
        start = torch.tensor(self.start, device=device)[:, None]
        valid = (ids >= start) & (ids < torch.tensor(self.length, device=device)[:, None])
        return valid, ids - start


def commit(cache, prefix_length: int, path: torch.Tensor) -> None:
    """Keep the KV entries of the accepted nodes right after the committed prefix; drop the rest of the tree."""
    if path.numel() == 1:  # the root is already in place
        cache.crop(prefix_length + 1)
    else:
        cache.keep_path(path + prefix_length, prefix_length)


def commit_batch(cache, rows: Rows, paths: list[torch.Tensor], tree_size: int) -> None:
    """Each row keeps the KV entries of its accepted nodes (the trees of ``tree_size`` nodes fill the cache's last
    slots) right after its own committed tokens; ``rows.length`` grows by each path's length. A row whose path
    already sits there (its committed tokens end where the trees begin and it accepted nodes 0, 1, ..., as plain
    decoding's root-only trees always do) moves nothing."""
    slots = cache.length - tree_size
    if len(paths) == 1 and rows.length[0] == slots:
        commit(cache, slots, paths[0])
        rows.length[0] += paths[0].numel()
        return
    counts = [path.numel() for path in paths]
    width, device = max(counts), paths[0].device
    padded = torch.nn.utils.rnn.pad_sequence(paths, batch_first=True)  # (B, width), 0-padded on the right
    last = torch.tensor(counts, device=device)[:, None] - 1
    sources = padded.gather(1, torch.arange(width, device=device).expand(len(paths), width).minimum(last))
    # Node ids ascend along a path from the root (node 0), so a path is 0, 1, ... exactly when it ends at count - 1.
    ends = padded.gather(1, last)[:, 0].tolist()
    moving = [b for b, (end, count, length) in enumerate(zip(ends, counts, rows.length))
              if end != count - 1 or length != slots]
    targets = torch.tensor([rows.length[b] for b in moving], device=device)[:, None]
    rows.length = [n + count for n, count in zip(rows.length, counts)]
    if not moving:
        cache.crop(max(rows.length))
        return
    index = torch.tensor(moving, device=device)
    targets = targets + torch.arange(width, device=device)
    cache.keep_rows(sources[index] + slots, targets, max(rows.length), rows=index)


def drop_finished(keep: list[int], rows: Rows, cache, drafter) -> Rows:
    """Shrink the batch to the rows ``keep`` (positions among the rows still generating): the cache's and the
    drafter's rows. Returns the rows kept."""
    index = torch.tensor(keep)
    cache.select_rows(index)
    drafter.select_rows(index)
    rows = rows.select(keep)
    cache.crop(max(rows.length))
    return rows
