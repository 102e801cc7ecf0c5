"""Reference-compatibility layer: the reference's public step functions (``eagle.model.utils``), with their names
and meaning, over this package's engine.

The reference's import paths (``eagle.model.cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``, ``kv_cache``)
are thin re-exports of the modules of this package (:mod:`eagle.model.compat`); the engine never imports them
(tests/test_reference_api.py checks it). ``EaModel``
does not use these functions (its loop is :class:`eagle.model.engine.loop.RunningBatch`); they adapt the
engine's pieces to the reference's calling conventions. The reference kept the draft's KV cache and the tree mask
on model attributes; here that state lives in the cache returned by
:func:`eagle.model.kv_cache.initialize_past_key_values`, and the tree mask is passed explicitly (or taken from
the last tree that :func:`initialize_tree` / :func:`update_inference_inputs` built on that cache).

Shapes: ``draft_tokens`` (1, N+1); ``retrieve_indices`` (leaves, depth+1), -1 padded; ``tree_mask``
(1, 1, N+1, N+1) float 0/1; ``tree_position_ids`` (N+1,) depths.
"""

from __future__ import annotations

import torch

from eagle.model.drafting.registry import drafter_for_head
from eagle.model.drafting.tree import DraftTree
from eagle.model.engine.acceptance import prepare_logits_processor  # noqa: F401  (re-exported, reference name)
from eagle.model.engine.acceptance import Sampler, choose_token, recursive_rejection

TOPK = 10

__all__ = ["TOPK", "initialize_tree", "tree_decoding", "evaluate_posterior", "update_inference_inputs",
           "reset_tree_mode", "pad_path", "generate_tree_buffers", "prepare_logits_processor"]


def _state(cache) -> dict:
    if not hasattr(cache, "eagle_state"):
        cache.eagle_state = {}
    return cache.eagle_state


def _sampler(logits_processor) -> Sampler | None:
    if logits_processor is None or len(logits_processor) == 0:
        return None
    sampler = Sampler(0.0)
    sampler.processors = logits_processor
    return sampler


def _outputs(tree: DraftTree):
    return (tree.tokens[None], tree.retrieve_indices, tree.ancestor_mask.float()[None, None], tree.depths)


@torch.no_grad()
def initialize_tree(input_ids, model, past_key_values, logits_processor):
    """Prefill the prompt (1, S) into ``past_key_values``, choose the first token and draft the first tree.

    Returns ``(draft_tokens, retrieve_indices, tree_mask, tree_position_ids, logits (1, 1, V), features, root
    (1, 1))``; the caller's ``input_ids`` still excludes the root."""
    state = _state(past_key_values)
    target = model.engine.target
    past_key_values.crop(0)
    out = target.prefill(input_ids, past_key_values)
    root = choose_token(out.logits[0, -1], _sampler(logits_processor))
    drafter = drafter_for_head(model.ea_layer, model.engine.plan)
    next_tokens = torch.cat([input_ids[0, 1:], root.reshape(1)])[None]
    tree = drafter.draft(out.features, next_tokens)
    state.update(drafter=drafter, tree=tree)
    return (*_outputs(tree), out.logits, out.features, root.reshape(1, 1))


@torch.no_grad()
def tree_decoding(model, tree_candidates, past_key_values, tree_position_ids, input_ids, retrieve_indices,
                  tree_mask=None):
    """Verify the tree: the target runs the N+1 tree tokens at positions ``len(input_ids) + depth``.

    Returns ``(logits[retrieve_indices] (leaves, depth+1, V), features (1, N+1, F), logits (N+1, V))``; index -1
    of ``retrieve_indices`` selects the last node (never used)."""
    if tree_mask is None:
        tree_mask = _state(past_key_values)["tree"].ancestor_mask
    mask = tree_mask.reshape(tree_mask.shape[-2], tree_mask.shape[-1]).bool()
    past_key_values.crop(input_ids.shape[1])
    out = model.engine.target.verify(tree_candidates, past_key_values, tree_position_ids.cpu() + input_ids.shape[1],
                                     mask)
    logits = out.logits[0]
    return logits[retrieve_indices], out.features, logits


def evaluate_posterior(logits, candidates, logits_processor, generator: torch.Generator | None = None):
    """Choose the accepted path from per-path logits ``(leaves, depth+1, V)`` and per-path tokens ``candidates``
    ``(leaves, depth+1)`` (column 0 = root, -1 padding).

    Returns ``(best path index, accept_length (int, tokens accepted after the root), distribution or logits for
    the next token)``: greedy returns the raw logits after the last accepted node; sampling (the engine's
    recursive rejection, :func:`eagle.model.engine.acceptance.recursive_rejection`, children tried in row order) returns the
    probability vector to draw the next token from."""
    if logits_processor is None or len(logits_processor) == 0:
        predicted = logits[:, :-1].argmax(dim=-1)
        matches = (candidates[:, 1:] == predicted) & (candidates[:, 1:] >= 0)
        accept = matches.long().cumprod(dim=1).sum(dim=1)
        best = int(accept.argmax())
        length = int(accept[best])
        return torch.tensor(best), length, logits[best, length]
    sampler = _sampler(logits_processor)
    sampler.generator = generator
    children, tokens, first_seen = _paths_as_tree(candidates)
    path, probs = recursive_rejection(children, tokens, lambda node: logits[first_seen[node]], sampler)
    return torch.tensor(first_seen[path[-1]][0]), len(path) - 1, probs


def _paths_as_tree(candidates: torch.Tensor):
    """The tree that per-path tokens ``candidates`` (leaves, depth+1) spell (column 0 the root, -1 padding): one
    node per distinct prefix, root 0. Returns (children of each node in row order, token of each node, (row,
    column) where each node first appears)."""
    rows = candidates.tolist()
    node_of = {(rows[0][0],): 0}
    tokens, first_seen = [rows[0][0]], [(0, 0)]
    children: dict[int, list[int]] = {}
    for row_index, row in enumerate(rows):
        for column in range(1, len(row)):
            if row[column] < 0:
                break
            prefix = tuple(row[: column + 1])
            if prefix not in node_of:
                node_of[prefix] = len(tokens)
                tokens.append(row[column])
                first_seen.append((row_index, column))
                children.setdefault(node_of[prefix[:-1]], []).append(node_of[prefix])
    return children, tokens, first_seen


@torch.no_grad()
def update_inference_inputs(input_ids, candidates, best_candidate, accept_length, retrieve_indices, logits_processor,
                            new_token, past_key_values_data_list, current_length_data, model, hidden_state_new,
                            sample_p, past_key_values=None):
    """Commit the accepted path (root + ``accept_length`` tokens), keep its KV entries, choose the next root from
    ``sample_p`` and draft the next tree. ``past_key_values`` is the cache (the reference found it on ``model``).

    Returns ``(input_ids, draft_tokens, retrieve_indices, tree_mask, tree_position_ids, new_token, None, root)``."""
    cache = past_key_values if past_key_values is not None else model.engine.cache
    state = _state(cache)
    prefix = input_ids.shape[1]
    best = int(best_candidate)
    path = retrieve_indices[best, : accept_length + 1]
    input_ids = torch.cat([input_ids, candidates[None, best, : accept_length + 1].to(input_ids.device)], dim=-1)
    cache.keep_path(path + prefix, prefix)
    if current_length_data is not None:
        current_length_data.fill_(prefix + accept_length + 1)
    features = hidden_state_new[:, path]
    if logits_processor is None or len(logits_processor) == 0:
        root = sample_p.argmax()
    else:
        root = torch.multinomial(sample_p, 1)[0]
    next_tokens = torch.cat([candidates[best, 1 : accept_length + 1], root.reshape(1)])[None]
    tree = state["drafter"].draft(features, next_tokens)
    state["tree"] = tree
    return (input_ids, *_outputs(tree), new_token + accept_length + 1, None, root.reshape(1, 1))


def reset_tree_mode(model) -> None:
    """Kept for compatibility: trees are passed explicitly here, so there is nothing to reset."""


def pad_path(path: list[int], length: int, pad_value: int = -2) -> list[int]:
    """``path`` padded with ``pad_value`` to ``length`` entries."""
    return path + [pad_value] * (length - len(path))


def generate_tree_buffers(tree_choices: list[list[int]], device="cpu") -> dict[str, torch.Tensor]:
    """The buffers of a static tree (e.g. :data:`eagle.model.choices.mc_sim_7b_63`, paths of top-k ranks), as the
    reference builds them; nothing in this package drafts static trees (EAGLE-2/3 trees are dynamic).

    Nodes are the root and the paths sorted by (length, path). Returns ``tree_attn_mask`` (1, 1, N+1, N+1) float,
    1 where a node sees itself, the root or an ancestor; ``tree_indices`` (N+1,), each node's index in the flat
    vector [root, TOPK candidates of each expanded node in order]; ``tree_position_ids`` (N+1,) depths;
    ``retrieve_indices`` (leaves, max depth + 1), the node ids of every maximal path, root first, -1 padded,
    rows in lexicographic order with the padding last."""
    paths = sorted((list(path) for path in tree_choices), key=lambda path: (len(path), path))
    node_of = {(): 0, **{tuple(path): index + 1 for index, path in enumerate(paths)}}
    size = len(paths) + 1
    mask = torch.eye(size)
    mask[:, 0] = 1.0
    indices = torch.zeros(size, dtype=torch.long)
    depths = torch.zeros(size, dtype=torch.long)
    parent_order: dict[tuple, int] = {}  # expanded nodes, in the order their children are met
    for path in paths:
        node = node_of[tuple(path)]
        for length in range(1, len(path)):
            mask[node, node_of[tuple(path[:length])]] = 1.0
        slot = parent_order.setdefault(tuple(path[:-1]), len(parent_order))
        indices[node] = 1 + TOPK * slot + path[-1]
        depths[node] = len(path)
    prefixes = {tuple(path[:length]) for path in paths for length in range(1, len(path))}
    leaves = [path for path in paths if tuple(path) not in prefixes]
    width = max((len(path) for path in paths), default=0) + 1
    rows = [pad_path([0] + [node_of[tuple(path[:length])] for length in range(1, len(path) + 1)], width, -1)
            for path in leaves]
    rows.sort(key=lambda row: [value if value >= 0 else size for value in row])
    return {
        "tree_attn_mask": mask[None, None].to(device),
        "tree_indices": indices.to(device),
        "tree_position_ids": depths.to(device),
        "retrieve_indices": torch.tensor(rows, dtype=torch.long).reshape(len(rows), width).to(device),
    }
