"""Two threads running the same model object at once compute what each computes alone: what a forward pass of
ours changes (the attention function, Llama 4's query temperature, the native decoder on the GGUF kernels) is
decided once, when the target is built (:class:`~eagle.model.base.plan.ForwardPlan`), and reaches the attention
through the model call itself; nothing is switched on the shared model around a pass. And the model's own
``generate`` computes after a target is built what it computed before."""

from __future__ import annotations

import threading

import pytest
import torch

from eagle import kernels
from eagle.model.base.target import Target
from eagle.model.ea_model import EaModel
from tiny_models import CHECKPOINT_FAMILIES, make_target

ROUNDS = 3


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _at_once(jobs) -> list:
    """Each job's result when all of them run at once, in threads started together."""
    barrier, results, errors = threading.Barrier(len(jobs)), [None] * len(jobs), []

    def run(index, job):
        try:
            barrier.wait()
            results[index] = job()
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index, job)) for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def assert_alone_equals_together(jobs) -> None:
    alone = [job() for job in jobs]
    for _ in range(ROUNDS):
        for index, (mine, reference) in enumerate(zip(_at_once(jobs), alone)):
            assert _same(mine, reference), f"job {index} computed otherwise beside the others"


def tree_passes(target: Target, prompt: list[int]):
    """A job: a prompt, then a 4-node tree after it (node positions != slots), through ``target``."""

    def job():
        cache = target.new_cache(len(prompt) + 4)
        first = target.prefill(torch.tensor([prompt]), cache, features=False, logits_to_keep=0)
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        nodes = torch.tensor([[prompt[0], prompt[1], prompt[2], prompt[3]]])
        second = target.verify(nodes, cache, len(prompt) + torch.tensor([0, 1, 1, 2]), tree, features=False)
        return [first.logits, second.logits]

    return job


def own_generate(model, ids: torch.Tensor, mask: torch.Tensor):
    """A job: the model's own greedy ``generate`` (transformers) of a left-padded batch, tokens and logits."""

    def job():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        return [out.sequences, *out.logits]

    return job


PADDED = torch.tensor([[0, 0, 0, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], list(range(40, 53))])


@pytest.mark.parametrize("family", ["llama", "llama-eager", "llama4_text"])
def test_one_target_in_two_threads_beside_the_models_own_generate(tmp_path, family):
    """Two threads verify trees through one target while a third runs the model's own generate: Llama 4's query
    temperature (positions, not slots, in our passes; slots in transformers' own) is where it matters most."""
    name, settings = CHECKPOINT_FAMILIES.get(family, (family.split("-")[0], {}))
    model = make_target(tmp_path / family, name, seed=3, layers=4, **settings)
    if family.endswith("eager"):
        model.config._attn_implementation = "eager"
    generate = own_generate(model, PADDED, (PADDED != 0).long())
    before = generate()
    target = Target(model, feature_layers=None)
    assert _same(generate(), before)  # the target's registration leaves plain transformers use as it was
    assert_alone_equals_together([tree_passes(target, list(range(30, 42))), tree_passes(target, list(range(70, 79))),
                                  generate])


def test_two_eagle_models_over_one_base_model_in_two_threads(tiny_pair):
    """Greedy EAGLE generation in two threads (two engines over the same base model and head, different prompts)
    and the model's own generate beside them: each gives what it gives alone."""
    base_dir, head_dir = tiny_pair
    first = EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir), total_token=8,
                                    depth=3, top_k=4)
    second = EaModel(first.base_model, first.ea_layer, first.tokenizer, 8, 3, 4, use_eagle3=True)

    def eagle(model, prompt):
        return lambda: model.eagenerate(torch.tensor([prompt]), max_new_tokens=16)

    assert_alone_equals_together([eagle(first, list(range(30, 42))), eagle(second, list(range(60, 66))),
                                  own_generate(first.base_model, PADDED, (PADDED != 0).long())])


@pytest.mark.e2e
@pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")
def test_the_gguf_kernels_native_decoder_in_two_threads():
    """The embedded GGUF pair on the kernels (native decoder, position-ordered kernel): EAGLE in two threads over
    one base model, and the model's own generate beside them."""
    first = EaModel.from_pretrained(gguf_kernels="float32")
    assert first.engine.target.forward_plan.native is not None
    second = EaModel(first.base_model, first.ea_layer, first.tokenizer, 8, 4, 4, use_eagle3=True)
    prompts = [first.tokenizer(text, return_tensors="pt").input_ids
               for text in ("What is the capital of France?", "Write a haiku about the sea.")]
    ids = torch.tensor([[0, 0, 0] + list(range(300, 310)), list(range(400, 413))])
    mask = torch.tensor([[0, 0, 0] + [1] * 10, [1] * 13])
    jobs = [lambda: first.eagenerate(prompts[0], max_new_tokens=12),
            lambda: second.eagenerate(prompts[1], max_new_tokens=12), own_generate(first.base_model, ids, mask)]
    assert_alone_equals_together(jobs)


def _imported(module: str) -> set[str]:
    """The eagle modules ``module`` imports, anywhere in its source."""
    import ast
    import importlib.util

    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}


def test_model_call_and_the_native_decoder_import_one_way():
    """The native decoder imports the model call's output type; the model call imports nothing of the plan, the
    native decoder or the target (no import circle)."""
    assert "eagle.model.base.model_call" in _imported("eagle.model.base.native_decoder")
    ours = {"eagle.model.base.native_decoder", "eagle.model.base.plan", "eagle.model.base.target"}
    assert not ours & _imported("eagle.model.base.model_call")


def test_a_forward_without_more_keyword_arguments_keeps_its_own_attention(tmp_path):
    """A forward that could not pass our pass down: nothing of ours is selected, and it serves as it is."""
    model = make_target(tmp_path / "base", "llama", seed=3, layers=2)

    class Closed(type(model)):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                    output_hidden_states=None, logits_to_keep=0):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=cache, use_cache=use_cache, output_hidden_states=output_hidden_states,
                                   logits_to_keep=logits_to_keep)

    model.__class__ = Closed
    target = Target(model, feature_layers=None)
    assert target.forward_plan.attention is None and model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        alone = model(ids).logits
    ours = target.prefill(ids, target.new_cache(4), features=False, logits_to_keep=0).logits
    torch.testing.assert_close(ours, alone)
