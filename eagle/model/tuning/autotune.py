"""``total_token=-1``: tune the whole draft tree (size, depth, top-k, lookup branch) on the device the model runs on.

The best tree is the one with the most tokens per second, and that is a product of two things measured here:

- costs on this device: verifying a tree of n tokens after a realistic context (timed for a few sizes and
  interpolated; with reading an accepted path's logits and the cache compaction after it), one draft of depth d
  and top-k k (timed), and the rest of a step (a plain decoding step minus a one-token verification); each the
  fastest of a few runs taken in turns, since other work on the machine only adds time and a change of load then
  hits every measurement alike;
- the head's acceptance on a few built-in calibration prompts: their greedy answers are recorded once with plain
  decoding (:func:`eagle.model.tuning.replay.record`), then the drafter drafts the deepest tree of each top-k at every
  position of every answer. Greedy verification accepts the longest path that spells the recorded continuation,
  and trees of smaller size and depth are prefixes of the deepest one (nodes kept by score), so one draft per
  position and top-k gives the accepted length of every size and depth, with and without a lookup branch. A
  walk over the answer (accept, move on) then gives tokens per step and tree tokens per step of every setting,
  as the simulator's replay would, without drafting again.

The predicted speed of a setting is ``tokens per step / (draft + verify(tree tokens) + rest of the step)``. The
winner is logged with the runner-up, the reference's 60/7/10 and plain decoding, and cached per device, base
model, head and dtype in a small JSON file (``$EAGLE_TREE_CACHE``, default ``~/.cache/eagle/trees.json``), so it
runs once. ``python -m eagle.evaluation.simulate --write-tree HEAD_DIR`` writes the result into a head.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from itertools import product

import torch
from tqdm import tqdm

from eagle.utils.device import synchronize

from eagle.model.drafting.eagle import EagleDrafter
from eagle.model.drafting.settings import TreePlan, TreeSettings
from eagle.model.engine.commit import commit
from eagle.model.engine.verify import verify_tree
from eagle.model.tuning.head_tree import REFERENCE_TREE, TREE_KEYS, device_kind
from eagle.model.drafting.lookup import find_continuation
from eagle.model.tuning.replay import Recording, record
from eagle.model.drafting.tree import tree_from_parents

logger = logging.getLogger(__name__)

CALIBRATION_PROMPTS = (
    "Describe how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five ways to save water at home and explain each one in a sentence.",
    "Write a Python function that checks whether a word is a palindrome, then explain how it works.",
)
CALIBRATION_TOKENS = 48
TOP_K_CHOICES = (2, 4, 6, 10)
MAX_DEPTH = 7
SIZE_CHOICES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 60)
LOOKUP_CHOICES = (0, 4, 8, 16, 32)
VERIFY_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)
PREFIX = 256
REPEATS = 5
CACHE_VERSION = 1


# ---------------------------------------------------------------------------------------------------- the choice
@dataclass
class StepCosts:
    """Seconds measured on a device: verifying ``verify_sizes[i]`` tree tokens takes ``verify_seconds[i]``
    (linear in between and beyond); a draft of top-k k and depth d takes ``draft_base[k] + d * draft_per_depth[k]``;
    ``overhead`` is the rest of a step (evaluation, commit, the loop); ``plain_step`` one plain decoding step."""

    verify_sizes: list[int]
    verify_seconds: list[float]
    draft_base: dict[int, float]
    draft_per_depth: dict[int, float]
    overhead: float
    plain_step: float

    def verify(self, size: float) -> float:
        sizes, seconds = self.verify_sizes, self.verify_seconds
        i = 1
        while i < len(sizes) - 1 and sizes[i] < size:
            i += 1
        slope = (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])
        return max(seconds[i - 1] + slope * (size - sizes[i - 1]), 0.0)

    def draft(self, depth: int, top_k: int) -> float:
        return self.draft_base[top_k] + depth * self.draft_per_depth[top_k]


@dataclass
class Prediction:
    settings: TreeSettings
    tokens_per_step: float
    tree_tokens_per_step: float
    seconds_per_step: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.seconds_per_step

    def describe(self) -> str:
        s = self.settings
        return (f"{s.total_token}/{s.depth}/{s.top_k}/{s.lookup_tokens}: {self.tokens_per_second:.1f} tokens/s "
                f"({self.tokens_per_step:.2f} tokens per step, {self.tree_tokens_per_step:.1f} tree tokens, "
                f"{self.seconds_per_step * 1e3:.1f} ms per step)")


def search_space(fixed: dict | None = None) -> list[TreeSettings]:
    """Every candidate tree; settings in ``fixed`` (e.g. ``{"depth": 3}``) take only the given value. Sizes
    beyond what a depth and top-k can draft (``top_k + depth * top_k**2`` nodes) are left out."""
    fixed = fixed or {}
    choices = {"total_token": SIZE_CHOICES, "depth": range(1, MAX_DEPTH + 1), "top_k": TOP_K_CHOICES,
               "lookup_tokens": LOOKUP_CHOICES}
    choices.update({key: (value,) for key, value in fixed.items()})
    space = []
    for total, depth, top_k, lookup in product(*(choices[key] for key in TREE_KEYS)):
        if total - 1 <= top_k + depth * top_k * top_k or "total_token" in fixed:
            space.append(TreeSettings(total, depth, top_k, lookup))
    return space


def predict(settings: TreeSettings, acceptance, costs) -> Prediction:
    """``acceptance(settings) -> (tokens per step, tree tokens verified per step)``; ``costs`` as
    :class:`StepCosts` (``draft(depth, top_k)``, ``verify(size)``, ``overhead``)."""
    tokens, tree_tokens = acceptance(settings)
    seconds = costs.draft(settings.depth, settings.top_k) + costs.verify(tree_tokens) + costs.overhead
    return Prediction(settings, tokens, tree_tokens, seconds)


def choose_tree(space: list[TreeSettings], acceptance, costs) -> list[Prediction]:
    """Predictions for every setting of ``space``, fastest first."""
    return sorted((predict(settings, acceptance, costs) for settings in space),
                  key=lambda p: p.tokens_per_second, reverse=True)


# ---------------------------------------------------------------------------------------------------- acceptance
@dataclass
class PositionRow:
    """What trees drafted at one root position would accept. ``accept[d][i]`` / ``shared[d][i]`` / ``size[d][i]``:
    for depth d and size ``SIZE_CHOICES[i]``, the draft tokens accepted, the lookup chain's leading tokens that
    are already tree nodes, and the tree's size; ``chain_accept[j]`` / ``chain_length[j]`` for lookup
    ``LOOKUP_CHOICES[j]``: the chain tokens accepted and the chain's length."""

    accept: list[list[int]]
    shared: list[list[int]]
    size: list[list[int]]
    chain_accept: list[int]
    chain_length: list[int]


def _spells(tree, sequence: torch.Tensor) -> torch.Tensor:
    """(N+1,) bool: node's path from the root spells the beginning of ``sequence`` (the root always does)."""
    depths, length = tree.depths, sequence.shape[0]
    if length == 0:
        ok = torch.zeros_like(depths, dtype=torch.bool)
    else:
        ok = (depths - 1 < length) & (tree.tokens == sequence[(depths - 1).clamp(0, length - 1)])
    ok[0] = True
    return ~(tree.ancestor_mask & ~ok[None]).any(dim=1)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    same = (a[:n] == b[:n]).long()
    return int(same.cumprod(0).sum()) if n else 0


def position_row(tree, answer: torch.Tensor, history: torch.Tensor, max_depth: int) -> PositionRow:
    """Everything about a root position from the full tree drafted there (all candidates, node order =
    generation order, as :func:`~eagle.model.drafting.tree.select_tree` keeps them): ``answer`` (the target's tokens after
    the root), ``history`` (the committed tokens the lookup branch searches, the root last)."""
    chains = [find_continuation(history, lookup) for lookup in LOOKUP_CHOICES]
    longest = max(chains, key=lambda c: c.shape[0])
    matched, chained = _spells(tree, answer), _spells(tree, longest.to(tree.tokens))
    order = torch.sort(tree.scores[1:], descending=True, stable=True).indices + 1  # select_tree's ranking
    row = PositionRow([], [], [], [_common_prefix(c.to(answer), answer) for c in chains],
                      [c.shape[0] for c in chains])
    for depth in range(max_depth + 1):
        kept = order[tree.depths[order] <= depth + 1]
        accept = torch.cummax(tree.depths[kept] * matched[kept], 0).values.tolist() if kept.numel() else []
        shared = torch.cummax(tree.depths[kept] * chained[kept], 0).values.tolist() if kept.numel() else []
        counts = [min(total - 1, len(kept)) for total in SIZE_CHOICES]
        row.accept.append([accept[m - 1] if m else 0 for m in counts])
        row.shared.append([shared[m - 1] if m else 0 for m in counts])
        row.size.append([m + 1 for m in counts])
    return row


@torch.no_grad()
def sweep_positions(head, recording: Recording, top_k: int, max_depth: int) -> list[PositionRow]:
    """Draft the full tree of ``top_k`` and ``max_depth`` at every root position of ``recording`` (the drafter
    commits one token at a time, so every position is a root once)."""
    drafter = EagleDrafter(head, TreePlan(TreeSettings(top_k + max_depth * top_k * top_k + 1, max_depth, top_k, 0)))
    drafter.reset()
    tokens, features, root = recording.tokens, recording.features, recording.prompt_length
    new_features, next_tokens = features[:, :root], tokens[1 : root + 1][None]
    rows = []
    for position in range(root, tokens.shape[0] - 1):
        tree = drafter.draft(new_features, next_tokens)
        rows.append(position_row(tree, tokens[position + 1 :], tokens[1 : position + 1], max_depth))
        new_features, next_tokens = features[:, position : position + 1], tokens[position + 1 : position + 2][None]
    return rows


class CalibrationAcceptance:
    """``acceptance(settings) -> (tokens per step, tree tokens per step)`` from swept positions: ``rows[top_k]``
    holds, per recorded answer, its :class:`PositionRow` list."""

    def __init__(self, rows: dict[int, list[list[PositionRow]]]):
        self.rows = rows

    def __call__(self, settings: TreeSettings) -> tuple[float, float]:
        swept = self.rows.get(settings.top_k)
        depths = len(swept[0][0].accept) if swept and swept[0] else 0
        if not swept or settings.depth >= depths or settings.total_token not in SIZE_CHOICES \
                or settings.lookup_tokens not in LOOKUP_CHOICES:
            raise KeyError(f"{settings} was not swept")
        d, i = settings.depth, SIZE_CHOICES.index(settings.total_token)
        j = LOOKUP_CHOICES.index(settings.lookup_tokens)
        steps = tokens = tree_tokens = 0
        for answer in self.rows[settings.top_k]:
            position = 0
            while position < len(answer):
                row = answer[position]
                accepted = max(row.accept[d][i], row.chain_accept[j])
                tree_tokens += row.size[d][i] + row.chain_length[j] - min(row.shared[d][i], row.chain_length[j])
                steps += 1
                tokens += accepted + 1
                position += accepted + 1
        if not steps:  # every calibration answer ended at once: nothing to learn about acceptance
            return 1.0, float(settings.total_token)
        return tokens / steps, tree_tokens / steps


def calibration_prompts(tokenizer) -> list[torch.Tensor]:
    """The built-in prompts as (1, S) ids, through the tokenizer's chat template when it has one."""
    prompts = []
    for text in CALIBRATION_PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tokenizer(text, return_tensors="pt").input_ids
        prompts.append(ids)
    return prompts


def measure_acceptance(model, top_ks, max_depth: int, progress) -> CalibrationAcceptance:
    """Record the calibration answers and sweep every position with each top-k."""
    recordings = []
    for ids in calibration_prompts(model.tokenizer):
        recordings.append(record(model, ids.to(model.device), CALIBRATION_TOKENS))
        progress.update(1)
    rows = {}
    for top_k in top_ks:
        rows[top_k] = [sweep_positions(model.ea_layer, rec, top_k, max_depth) for rec in recordings]
        progress.update(1)
    return CalibrationAcceptance(rows)


# ---------------------------------------------------------------------------------------------------- costs
def best_seconds(runs: dict, repeats: int, device, progress=None) -> dict:
    """Seconds of each of ``runs`` (name -> function), the fastest of ``repeats`` timings after one warm-up. The
    runs take turns (round-robin), so a change of load on a shared machine hits every run alike, and other work
    only ever adds time, so the minimum is the estimate it disturbs least."""
    timings = {name: [] for name in runs}
    with torch.no_grad():
        for repeat in range(repeats + 1):
            for name, run in runs.items():
                synchronize(device)
                start = time.perf_counter()
                run()
                synchronize(device)
                if repeat:
                    timings[name].append(time.perf_counter() - start)
            if progress is not None:
                progress.update(1)
    return {name: min(values) for name, values in timings.items()}


def verification_run(model, size: int, prefix: int = PREFIX, top_k: int = 4):
    """A function that verifies a ``size``-node tree after a ``prefix``-token context as a step of the loop does:
    the target forward, reading the logits rows of a 3-token path (on a CPU only the rows read go through the LM
    head) and keeping that path's KV entries (the cache compaction, a copy in every layer)."""
    target, vocab, device = model.engine.target, model.vocab_size, model.device
    cache = target.new_cache(prefix + size + 1)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, prefix), generator=generator).to(device)
    parents = torch.tensor([-1] + [(i - 1) // top_k for i in range(1, size)])  # a bushy tree
    tree = tree_from_parents(torch.randint(0, vocab, (size,), generator=generator).to(device), parents.to(device),
                             torch.zeros(size, device=device))
    path = [node for node in tree.retrieve_indices[0][:3].tolist() if node >= 0]
    kept = torch.tensor(path, device=device)
    with torch.no_grad():
        target.prefill(context, cache)

    def run():
        cache.crop(prefix)
        logits, _ = verify_tree(target, tree, cache, lazy_logits=True)
        for node in path:
            logits[node].argmax()
        commit(cache, prefix, kept)

    return run


def draft_run(model, top_k: int, depth: int, prefix: int = PREFIX):
    """A function that drafts once (a committed token, then the tree of ``top_k`` and ``depth``) after a
    ``prefix``-token context."""
    head, device = model.ea_layer, model.device
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, prefix + 1, head.feature_size, generator=generator).to(device)
    tokens = torch.randint(0, model.vocab_size, (1, prefix + 1), generator=generator).to(device)
    drafter = EagleDrafter(head, TreePlan(TreeSettings(min(16, top_k + depth * top_k * top_k + 1), depth, top_k, 0)))
    with torch.no_grad():
        drafter.reset()
        drafter.draft(features[:, :prefix], tokens[:, :prefix])
    context_kv = drafter.committed_kv

    def run():
        drafter.committed_kv = context_kv
        drafter.draft(features[:, prefix:], tokens[:, prefix:])

    return run


def time_plain_step(model, prefix: int = PREFIX, repeats: int = REPEATS) -> float:
    """Seconds of the fastest plain decoding step after a ``prefix``-token prompt (the whole step of the loop)."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (1, prefix), generator=generator).to(model.device)
    steps = model.generate_steps(prompt, max_new_tokens=repeats + 2, max_length=prefix + repeats + 3,
                                 use_eagle=False)
    timings, start = [], None
    with torch.no_grad():
        for _ in steps:
            synchronize(model.device)
            now = time.perf_counter()
            if start is not None:
                timings.append(now - start)
            start = now
    return min(timings[1:] or timings)


def measure_costs(model, top_ks, max_depth: int, progress=None) -> StepCosts:
    """Time verification at :data:`VERIFY_SIZES`, drafts of every top-k at depths 1 and ``max_depth`` (all in
    turns, see :func:`best_seconds`), and a plain step, whose part besides a one-token verification is the rest
    of a step (evaluation, commit, the loop)."""
    deep = max(max_depth, 2)
    runs = {("verify", size): verification_run(model, size) for size in VERIFY_SIZES}
    for top_k in top_ks:
        runs[("draft", top_k, 1)] = draft_run(model, top_k, 1)
        runs[("draft", top_k, deep)] = draft_run(model, top_k, deep)
    seconds = best_seconds(runs, REPEATS, model.device, progress)
    verify_seconds = [seconds[("verify", size)] for size in VERIFY_SIZES]
    base, per_depth = {}, {}
    for top_k in top_ks:
        shallow = seconds[("draft", top_k, 1)]
        per_depth[top_k] = max(seconds[("draft", top_k, deep)] - shallow, 0.0) / (deep - 1)
        base[top_k] = max(shallow - per_depth[top_k], 0.0)
    plain_step = time_plain_step(model)
    return StepCosts(list(VERIFY_SIZES), verify_seconds, base, per_depth, max(plain_step - verify_seconds[0], 0.0),
                     plain_step)


# ---------------------------------------------------------------------------------------------------- tune + cache
def cache_path() -> str:
    """``$EAGLE_TREE_CACHE``, else ``trees.json`` in the user's cache directory (``$XDG_CACHE_HOME/eagle``)."""
    if os.environ.get("EAGLE_TREE_CACHE"):
        return os.environ["EAGLE_TREE_CACHE"]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "eagle", "trees.json")


def device_name(device: torch.device) -> str:
    """The device's model (and, for a CPU, the threads torch uses): tuned trees are cached per device."""
    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
        except OSError:
            pass
        return f"cpu {name}, {torch.get_num_threads()} threads"
    return device.type


def cache_key(model, fixed: dict) -> str:
    paths = [os.path.abspath(p) if p and os.path.exists(p) else str(p)
             for p in (model.base_model_name_or_path, getattr(model, "ea_model_path", None))]
    dtypes = (model.base_model.get_input_embeddings().weight.dtype, model.ea_layer.weight.dtype)
    fixed_text = ",".join(f"{key}={fixed[key]}" for key in sorted(fixed))
    return (f"v{CACHE_VERSION} | {device_name(model.device)} | base {paths[0]} | head {paths[1]} | "
            f"{dtypes[0]}/{dtypes[1]} | fixed {fixed_text or '-'}")


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _write_cache(path: str, key: str, entry: dict) -> None:
    cache = _read_cache(path)
    cache[key] = entry
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(cache, f, indent=2)
    os.replace(path + ".tmp", path)


def log_choice(ranking: list[Prediction], acceptance, costs, kind: str) -> None:
    """Say what was chosen and why: the winner against the runner-up, the reference's tree and plain decoding."""
    best = ranking[0]
    logger.info("total_token=-1: tuned the tree for this %s: %s", kind, best.describe())
    if len(ranking) > 1:
        logger.info("  runner-up %s", ranking[1].describe())
    try:
        reference = predict(REFERENCE_TREE, acceptance, costs)
        logger.info("  reference %s (chosen: %.2fx)", reference.describe(),
                    best.tokens_per_second / reference.tokens_per_second)
    except KeyError:
        pass  # the reference tree was outside the search (a fixed top-k or depth)
    logger.info("  plain decoding: %.1f tokens/s (chosen: %.2fx); verifying 1/8/32 tokens %.1f/%.1f/%.1f ms",
                1 / costs.plain_step, best.tokens_per_second * costs.plain_step,
                costs.verify(1) * 1e3, costs.verify(8) * 1e3, costs.verify(32) * 1e3)


def tune_tree(model, fixed: dict | None = None, use_cache: bool = True) -> TreeSettings:
    """The fastest tree for ``model`` on its device (settings in ``fixed`` stay as given), from the cache when
    this device, base model, head and dtype were tuned before; otherwise measured (about a minute on a 2-core
    CPU for SmolLM2-135M), logged and cached."""
    fixed = dict(fixed or {})
    key, path = cache_key(model, fixed), cache_path()
    entry = _read_cache(path).get(key) if use_cache else None
    if entry is not None:
        settings = TreeSettings(**entry["tree"])
        logger.info("total_token=-1: tuned tree %s/%s/%s/%s from the cache %s (measured %s)", settings.total_token,
                    settings.depth, settings.top_k, settings.lookup_tokens, path, entry.get("measured", "?"))
        return settings
    space = search_space(fixed)
    top_ks = sorted({s.top_k for s in space})
    max_depth = max(s.depth for s in space)
    sweep_ks = sorted(set(top_ks) | ({REFERENCE_TREE.top_k} if not fixed else set()))
    with torch.no_grad(), tqdm(total=len(CALIBRATION_PROMPTS) + len(sweep_ks) + REPEATS + 1,
                               desc="tuning the draft tree") as progress:
        acceptance = measure_acceptance(model, sweep_ks, max_depth, progress)
        costs = measure_costs(model, sweep_ks, max_depth, progress)
    ranking = choose_tree(space, acceptance, costs)
    log_choice(ranking, acceptance, costs, device_kind(model.device))
    best = ranking[0]
    _write_cache(path, key, {"tree": asdict(best.settings), "tokens_per_second": best.tokens_per_second,
                             "measured": datetime.datetime.now().isoformat(timespec="seconds")})
    return best.settings
