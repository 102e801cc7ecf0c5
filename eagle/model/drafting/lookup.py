"""Prompt-lookup branch: a chain of tokens copied from earlier in the context, grafted onto the EAGLE draft tree.

Text often repeats what came before it (a rewritten paragraph, a list that restates the question, code that
reuses names, a small model repeating itself). When the last few tokens occurred earlier in the context, the
tokens that followed them then are a cheap guess for what follows now: that is prompt-lookup decoding
(transformers' ``prompt_lookup_num_tokens``). The EAGLE head proposes at most ``depth + 1`` tokens per step; a
lookup chain can be longer, and costs nothing to draft.

The chain joins the tree from the root: where its first tokens are already nodes of the tree it follows them,
then hangs the rest as new nodes. Siblings stay distinct, so verification (greedy or sampling) treats the grafted
nodes like any other draft token and stays lossless; only the number of tokens verified per step grows (by at
most ``lookup_tokens``, and only when the context holds a match).
"""

from __future__ import annotations

import torch

from eagle.model.drafting.protocol import Combinator
from eagle.model.drafting.tree import DraftTree, merge_below_root, tree_from_parents

MAX_NGRAM = 3
MIN_NGRAM = 1
# Cumulative draft score given to a grafted node: its parent's plus this (log 1e-3). Scores only order siblings in
# sampling verification, so a grafted node is tried after the head's own proposals for the same parent.
GRAFT_LOG_PROB = -6.9


def find_continuation(history: torch.Tensor, max_tokens: int, max_ngram: int = MAX_NGRAM,
                      min_ngram: int = MIN_NGRAM) -> torch.Tensor:
    """The tokens that followed the most recent earlier occurrence of the context's last ``n`` tokens.

    history: (T,) token ids, the last one being the token the next step starts from. Tries ``n = max_ngram`` down
    to ``min_ngram``. A match of ``max_ngram`` tokens earns a chain of up to ``max_tokens`` tokens, and each token
    less halves that (16, 8, 4 for ``max_tokens=16``): a single matching token is weak evidence, and on text that
    does not repeat its long chains would be verified for nothing. Returns an empty tensor when nothing matches."""
    return find_match(history, max_tokens, max_ngram, min_ngram)[0]


def find_match(history: torch.Tensor, max_tokens: int, max_ngram: int = MAX_NGRAM,
               min_ngram: int = MIN_NGRAM) -> tuple[torch.Tensor, int]:
    """:func:`find_continuation` and the length ``n`` of the match it came from (0 when none)."""
    length = history.shape[0]
    for n in range(max_ngram, min_ngram - 1, -1):
        if length <= n:
            continue
        windows = history[:-1].unfold(0, n, 1)  # every earlier n-gram that has at least one token after it
        starts = (windows == history[-n:]).all(dim=1).nonzero()
        if starts.numel():
            begin = int(starts[-1]) + n
            return history[begin : begin + (max_tokens >> (max_ngram - n))], n
    return history[:0], 0


def graft_chain(tree: DraftTree, chain: torch.Tensor) -> DraftTree:
    """The tree with ``chain`` (k,) hung below the root (:func:`~eagle.model.drafting.tree.merge_below_root` of a
    one-path trie): followed through existing nodes while they match, then the rest added as new nodes, each the
    child of the one before and scored :data:`GRAFT_LOG_PROB` per step below the last node followed. Returns
    ``tree`` itself when nothing is added."""
    _, parents = merge_below_root(tree, chain.tolist(), list(range(-1, chain.numel() - 1)))
    if not parents:
        return tree
    # The new nodes are the chain's last ones: after the first new token nothing can be followed.
    count, device = len(parents), tree.tokens.device
    steps = torch.arange(1, count + 1, device=device, dtype=tree.scores.dtype)
    return tree_from_parents(
        torch.cat([tree.tokens, chain[chain.numel() - count:].to(tree.tokens)]),
        torch.cat([tree.parents, torch.tensor(parents).to(tree.parents)]),
        torch.cat([tree.scores, tree.scores[parents[0]] + GRAFT_LOG_PROB * steps]),
    )


# Tokens a prompt-lookup drafter alone (``"lookup"``, no head) grafts per step at most: transformers' default
# ``prompt_lookup_num_tokens``.
STANDALONE_LOOKUP_TOKENS = 10
# Tokens ``+lookup`` grafts onto a drafter's own tree when no tree of the plan names a lookup length (a tree tuned
# or given with ``lookup_tokens=0``, asked for ``"eagle3+lookup"`` by name): the length the CPU trees tuned with a
# lookup branch take.
GRAFTED_LOOKUP_TOKENS = 4


class LookupDrafter(Combinator):
    """Prompt lookup around any drafter: each row's tree from ``inner``, with the row's lookup chain grafted below
    its root (:func:`graft_chain`) when the context's last tokens occurred before.

    ``tokens_for(batch_size)``: the most chain tokens a row grafts in a batch of that many rows (0: none). Per row
    it keeps its committed tokens (the prompt without its first token, then everything emitted), where the chain is
    searched."""

    def __init__(self, inner, tokens_for):
        super().__init__(inner, tokens_for)
        self.history: list[torch.Tensor | None] = []

    @classmethod
    def around(cls, context, inner) -> "LookupDrafter":
        """The registry's ``+lookup``: chains as long as the plan's trees say; where none of them grafts a chain,
        :data:`STANDALONE_LOOKUP_TOKENS` around a drafter that proposes nothing of its own and
        :data:`GRAFTED_LOOKUP_TOKENS` around a head (asked for by name, ``+lookup`` is never a no-op)."""
        if not context.plan.looks_up:
            tokens = GRAFTED_LOOKUP_TOKENS if inner.needs_features else STANDALONE_LOOKUP_TOKENS
            return cls(inner, lambda batch_size: tokens)
        return cls(inner, lambda batch_size: context.plan.for_batch(batch_size).lookup_tokens)

    def reset_rows(self, batch_size: int) -> None:
        self.history = [None] * batch_size

    def observe_rows(self, next_tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        for row in range(next_tokens.shape[0]):
            new = next_tokens[row] if valid is None else next_tokens[row][valid[row]]
            history = self.history[row]
            self.history[row] = new if history is None else torch.cat([history, new])

    def graft_row(self, tree: DraftTree, row: int, limit: int) -> DraftTree:
        chain = find_match(self.history[row], limit)[0]
        return graft_chain(tree, chain) if chain.numel() else tree

    def keep_rows(self, index: torch.Tensor) -> None:
        self.history = [self.history[i] for i in index.tolist()]

    def join_rows(self, next_tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        self.history += [row if valid is None else row[valid[b]] for b, row in enumerate(next_tokens)]
