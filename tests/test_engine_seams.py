"""The engine's seams: drafters are built by name from a registry (a new kind plugs in with one call), prompt lookup
combines with any drafter, every step says why a row ended, and the embedded-pair module imports nothing of the
engine."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.model.drafting import protocol, registry
from eagle.model.drafting.lookup import LookupDrafter
from eagle.model.drafting.none import NoDrafter
from eagle.model.drafting.protocol import DraftContext, StepDrafter
from eagle.model.drafting.registry import build_drafter, register_drafter
from eagle.model.drafting.settings import TreePlan, TreeSettings
from eagle.model.drafting.tree import DraftTree, tree_from_parents


class ChainDrafter(StepDrafter):
    """A new drafter kind: proposes a fixed chain of ``width`` tokens (``offset`` + the root's id) after each root,
    right or wrong: the target decides."""

    needs_features = False

    def __init__(self, width: int = 3, offset: int = 1):
        self.width, self.offset, self.roots = width, offset, None

    def reset(self, batch_size: int = 1) -> None:
        self.roots = None

    def observe(self, features, next_tokens, valid=None) -> None:
        self.roots = protocol.roots_of(next_tokens, valid)

    def propose(self) -> list[DraftTree]:
        trees = []
        for root in self.roots:
            chain = (root + self.offset + torch.arange(self.width, device=root.device)) % 128
            tokens = torch.cat([root.reshape(1), chain])
            trees.append(tree_from_parents(tokens, torch.arange(-1, self.width), -torch.arange(self.width + 1.0)))
        return trees

    def select_rows(self, index) -> None:
        self.roots = self.roots[index.to(self.roots.device)]

    def add_rows(self, features, next_tokens, valid=None) -> None:
        pass

    def max_nodes(self, batch_size: int) -> int:
        return self.width + 1


@pytest.fixture()
def chain_registered():
    register_drafter("chain", lambda context: ChainDrafter())
    yield
    registry.DRAFTERS.pop("chain", None)


def _greedy(base_dir, prompt, new_tokens):
    reference = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    return reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)[0].tolist()


def _run(model, prompts, drafter, **settings):
    request = model.engine.request(prompts, drafter=drafter, **settings)
    steps = list(model.engine.run(request))
    rows = [[t for step in steps for t in step.tokens[b].tolist()] for b in range(request.batch_size)]
    return rows, steps


def test_a_registered_drafter_runs_in_the_loop_and_stays_lossless(tiny_model, tiny_pair, chain_registered):
    prompt = [1, 44, 45, 46, 47]
    rows, steps = _run(tiny_model, [prompt], "chain", max_new_tokens=20)
    assert prompt + rows[0] == _greedy(tiny_pair[0], prompt, 20)
    assert len(steps) <= 21


def test_prompt_lookup_combines_with_any_drafter(tiny_model, tiny_pair, chain_registered):
    """``lookup`` alone is prompt-lookup decoding; ``chain+lookup`` grafts chains onto another kind's trees."""
    prompt = [1, 30, 31, 32, 33, 30, 31, 32, 33, 30, 31]
    expected = _greedy(tiny_pair[0], prompt, 24)
    for spec in ("lookup", "none+lookup", "chain+lookup"):
        rows, _ = _run(tiny_model, [prompt, [1, 9, 8]], spec, max_new_tokens=24)
        assert prompt + rows[0] == expected, spec
    drafter = build_drafter("chain+lookup", DraftContext(None, TreePlan()))
    assert isinstance(drafter, LookupDrafter) and isinstance(drafter.inner, ChainDrafter)
    assert isinstance(build_drafter("lookup", DraftContext(None, TreePlan())).inner, NoDrafter)


def test_unknown_drafters_are_refused_with_what_is_available():
    with pytest.raises(ValueError, match="Unknown drafter 'medusa'.*available: .*eagle1.*eagle3.*none"):
        build_drafter("medusa", DraftContext(None, TreePlan()))
    with pytest.raises(ValueError, match="Unknown drafter combinator 'cache'"):
        build_drafter("none+cache", DraftContext(None, TreePlan()))
    with pytest.raises(ValueError, match="needs a draft head"):
        build_drafter("eagle3", DraftContext(None, TreePlan()))
    with pytest.raises(ValueError, match="without '\\+'"):
        register_drafter("a+b", lambda context: NoDrafter())


def test_the_head_drafter_follows_the_plan(tiny_model):
    assert tiny_model.engine.drafter_spec("head") == "eagle3"
    tiny_model.set_tree(8, 2, 3, 5)
    try:
        assert tiny_model.engine.drafter_spec("head") == "eagle3+lookup"
        assert tiny_model.engine.drafter("head").max_nodes(1) == 8 + 5
    finally:
        tiny_model.set_tree(12, 3, 4, 0)
    plan = TreePlan(TreeSettings(8, 2, 3, 0), {4: TreeSettings(3, 1, 2, 2)})
    assert plan.looks_up and plan.largest_tree(8) == 8 and plan.for_batch(5).lookup_tokens == 2


def test_every_row_ends_with_its_reason(tiny_model):
    stop = tiny_model.engine.request([[1, 5]], max_new_tokens=6)
    first = [t for step in tiny_model.engine.run(stop) for t in step.tokens[0].tolist()]
    request = tiny_model.engine.request([[1, 5], [1, 6, 7]], max_new_tokens=6, stop_ids={first[2]})
    steps = list(tiny_model.engine.run(request))
    reasons = steps[-1].finish_reasons
    assert reasons[0] == "stop" and reasons[1] in ("stop", "length")
    ended = [next(i for i, step in enumerate(steps) if step.rows[b].finished) for b in range(2)]
    for b, index in enumerate(ended):  # a row's reason comes with its last tokens and stays
        assert all(step.rows[b].finish_reason is None for step in steps[:index])
        assert all(step.rows[b].tokens.numel() == 0 for step in steps[index + 1:])


def test_a_cancelled_row_is_reported_cancelled(tiny_model):
    batch = tiny_model.continuous_batch()
    (kept,) = batch.add(torch.tensor([1, 5, 6]), max_new_tokens=6)
    (gone,) = batch.add(torch.tensor([1, 7, 8]), max_new_tokens=6)
    reasons = {}
    for index, update in enumerate(batch):
        if index == 1:
            batch.cancel(gone)
        for row, part in update.items():
            if part.finished:
                reasons[row] = part.finish_reason
    assert reasons == {kept: "length", gone: "cancelled"}


def test_the_embedded_pair_module_imports_nothing_of_the_engine():
    code = ("import sys, eagle.defaults; "
            "sys.exit(sorted(m for m in sys.modules if m.startswith(('eagle.model', 'eagle.cli'))) != [])")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_base_model_alone_decodes_plainly_and_with_head_less_drafters(tiny_pair, chain_registered):
    from eagle.model.ea_model import EaModel

    base = str(tiny_pair[0])
    model = EaModel.from_pretrained(base_model_path=base, load_head=False)
    assert model.ea_layer is None and not model.use_eagle3
    prompt = [1, 44, 45, 46, 47]
    expected = _greedy(tiny_pair[0], prompt, 12)
    assert model.naivegenerate(torch.tensor([prompt]), temperature=0.0, max_new_tokens=12)[0].tolist() == expected
    assert prompt + _run(model, [prompt], "chain", max_new_tokens=12)[0][0] == expected  # a drafter without a head
    with pytest.raises(ValueError, match="no draft head"):
        model.eagenerate(torch.tensor([prompt]), temperature=0.0, max_new_tokens=4)
    with pytest.raises(ValueError, match="load_head=False loads the base model alone"):
        EaModel.from_pretrained(base_model_path=base, ea_model_path=str(tiny_pair[1]), load_head=False)
