"""Tree settings in one place: the reference's defaults, the tree a head carries, and how a load resolves them.

A draft tree that fits one device wastes another: on a GPU verifying 60 tokens costs about as much as one, so the
reference's 60/7/10 tree pays; on a CPU every verified token costs time, and a small shallow tree wins. So a head
carries the tree it was tuned for, per kind of device, in its ``config.json``::

    "eagle_tree": {
        "cpu":  {"total_token": 8, "depth": 2, "top_k": 4, "lookup_tokens": 16},
        "cuda": {"total_token": 48, "depth": 6, "top_k": 8, "lookup_tokens": 0}
    }

Keys are ``torch.device`` types (``cpu``, ``cuda``, ``mps``, ``xpu``...); each value holds any of the four
settings (a missing one takes the reference's default). ``EaModel.from_pretrained`` resolves each setting on its
own: an explicit argument first, then the head's tree for the kind of device the base model runs on, then the
reference's default (:data:`REFERENCE_TREE`, 60/7/10 without lookup). ``python -m eagle.evaluation.simulate
--write-tree HEAD_DIR`` tunes a tree on the device it runs on and writes it there (:func:`write_head_tree`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace

import torch

from eagle.model.drafting.settings import TreeSettings

logger = logging.getLogger(__name__)

TREE_FIELD = "eagle_tree"
TREE_KEYS = ("total_token", "depth", "top_k", "lookup_tokens")
# The reference's from_pretrained defaults (total_token=60, depth=7, top_k=10), without the lookup branch.
REFERENCE_TREE = TreeSettings(total_token=60, depth=7, top_k=10, lookup_tokens=0)


def device_kind(device) -> str:
    """``"cpu"``, ``"cuda"``, ``"mps"``...: the key of a head's tree for ``device``."""
    return torch.device(device).type


def tree_kinds(device, backend: str | None = None) -> list[str]:
    """The keys of a head's trees to look up for ``device``, best first: with a linear ``backend`` whose costs
    differ (``"gguf"``: the GGUF kernels, where verifying ten rows costs several times one row; ``"gguf-int8"``:
    the same with int8 activations), its own key (``"cpu-gguf-int8"``), then each shorter one (``"cpu-gguf"``),
    then the device's."""
    kind = device_kind(device)
    parts = backend.split("-") if backend else []
    return [f"{kind}-{'-'.join(parts[:n])}" for n in range(len(parts), 0, -1)] + [kind]


def kernel_backend(numerics: str | None) -> str | None:
    """The tree key's backend of a model on the GGUF kernels with ``numerics`` (``"float32"``: ``"gguf"``,
    ``"int8"``: ``"gguf-int8"``, whose rows cost differently again), None for a model off the kernels."""
    if numerics is None:
        return None
    return "gguf" if numerics == "float32" else f"gguf-{numerics}"


def first_tree(trees: dict, kinds: list[str]):
    """The entry of ``trees`` for the first of ``kinds`` it has (None: none)."""
    return next((trees[kind] for kind in kinds if kind in trees), None)


def parse_head_trees(value, source: str = "the head's config.json") -> dict[str, dict[str, int]]:
    """Check an ``eagle_tree`` field (None: no tree) and return it as ``{device kind: {setting: int}}``."""
    if value is None:
        return {}
    expected = (f'expected {{"cpu": {{"total_token": 8, "depth": 2, "top_k": 4, "lookup_tokens": 16}}, ...}}, '
                f"keys {', '.join(TREE_KEYS)}")
    if not isinstance(value, dict):
        raise ValueError(f"{TREE_FIELD} in {source} must be an object by device kind; {expected}.")
    trees = {}
    for kind, tree in value.items():
        check_tree_entry(tree, f"{TREE_FIELD}[{kind!r}]", source, expected)
        trees[kind] = dict(tree)
    return trees


def check_tree_entry(tree, label: str, source: str, expected: str, base: TreeSettings = REFERENCE_TREE
                     ) -> TreeSettings:
    """One tree of a head's config.json (``{setting: int}``, some settings may be left out), named ``label`` in
    errors: checked, and returned as ``base`` with its settings replaced."""
    if not isinstance(tree, dict) or set(tree) - set(TREE_KEYS):
        raise ValueError(f"{label} in {source} is {tree!r}; {expected}.")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in tree.values()):
        raise ValueError(f"{label} in {source} must hold integers, got {tree!r}.")
    try:
        return replace(base, **tree)
    except ValueError as err:
        raise ValueError(f"{label} in {source}: {err}") from None


def head_tree_kind(config, device, backend: str | None = None) -> tuple[str | None, dict[str, int]]:
    """The first of :func:`tree_kinds` that a head's config (an ``EConfig`` or a dict) has a tree for, and that
    tree; ``(None, {})`` if none."""
    value = config.get(TREE_FIELD) if isinstance(config, dict) else getattr(config, TREE_FIELD, None)
    trees = parse_head_trees(value)
    kind = next((kind for kind in tree_kinds(device, backend) if kind in trees), None)
    return kind, trees.get(kind, {})


def head_tree_for(config, device, backend: str | None = None) -> dict[str, int]:
    """The settings a head's config (an ``EConfig`` or a dict) gives for ``device``'s kind (with ``backend``:
    see :func:`tree_kinds`); empty if none."""
    return head_tree_kind(config, device, backend)[1]


def resolve_tree(explicit: dict, head_tree: dict | None = None) -> tuple[TreeSettings, dict[str, str]]:
    """Each setting from ``explicit`` (None = not given), else ``head_tree``, else :data:`REFERENCE_TREE`.

    Returns the settings and, per setting, where it came from (``"argument"``, ``"head"``, ``"default"``).
    ``total_token=-1`` (tune on this device) is returned as the tree to start from (60 unless the head has one)."""
    values, sources = {}, {}
    for key in TREE_KEYS:
        given = explicit.get(key)
        if given is not None and not (key == "total_token" and given == -1):
            values[key], sources[key] = given, "argument"
        elif head_tree and key in head_tree:
            values[key], sources[key] = head_tree[key], "head"
        else:
            values[key], sources[key] = getattr(REFERENCE_TREE, key), "default"
    if explicit.get("total_token") == -1:
        sources["total_token"] = "tuned"
    return TreeSettings(**values), sources


def check_tree_arguments(total_token, depth, top_k, lookup_tokens) -> None:
    """Fail before anything loads when a given setting is invalid (None = not given; total_token -1 = tune)."""
    for name, value in (("total_token", total_token), ("depth", depth), ("top_k", top_k),
                        ("lookup_tokens", lookup_tokens)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name} must be an integer or None (not given), got {value!r}.")
    given = {"total_token": None if total_token == -1 else total_token, "depth": depth, "top_k": top_k,
             "lookup_tokens": lookup_tokens}
    TreeSettings(**{key: getattr(REFERENCE_TREE, key) if value is None else value for key, value in given.items()})


def head_config_path(head_dir: str) -> str:
    path = os.path.join(head_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{head_dir} has no config.json: pass the directory of a draft head.")
    return path


def read_head_trees(head_dir: str) -> dict[str, dict[str, int]]:
    """The ``eagle_tree`` field of ``head_dir/config.json`` (empty when the head carries no tree)."""
    path = head_config_path(head_dir)
    with open(path) as f:
        return parse_head_trees(json.load(f).get(TREE_FIELD), path)


def write_head_tree(head_dir: str, kind: str, settings: TreeSettings) -> str:
    """Set ``head_dir/config.json``'s tree for device kind ``kind`` (other kinds and fields kept). Returns the path."""
    path = head_config_path(head_dir)
    with open(path) as f:
        config = json.load(f)
    trees = parse_head_trees(config.get(TREE_FIELD), path)
    trees[kind] = {key: int(getattr(settings, key)) for key in TREE_KEYS}
    config[TREE_FIELD] = trees
    with open(path + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)
    logger.info("Wrote the %s tree %s into %s", kind, trees[kind], path)
    return path


def embedded_tree_settings(kind: str = "cpu") -> dict:
    """``{"total_token", "depth", "top_k", "lookup_tokens"}`` the embedded default head carries for ``kind`` of
    device (its config.json's ``eagle_tree``; the reference's defaults for a kind it has no tree for): what
    ``from_pretrained`` uses there when no tree argument is given."""
    from dataclasses import asdict

    from eagle.defaults import default_ea_model_path

    return asdict(resolve_tree({}, read_head_trees(default_ea_model_path()).get(kind))[0])
