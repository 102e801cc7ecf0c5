"""Choosing a drafter by name: ``EaModel.from_pretrained(drafter=...)``, ``drafter=`` on the generation methods, the
reference's ``use_eagle`` / ``use_eagle3`` as aliases, the checks of ``eagle.model.drafting.registry``, the CLI's
``--drafter`` and the benchmark's methods named by drafter spec."""

from __future__ import annotations

import pytest
import torch

from eagle.model.drafting.registry import (
    DRAFTERS, HEAD, HEAD_VERSIONS, check_drafter, reference_drafter, register_drafter, runnable_drafters,
)
from eagle.model.drafting.none import NoDrafter
from eagle.model.ea_model import EaModel
from tiny_models import make_head

PROMPT = [1, 44, 45, 46, 47, 44, 45, 46]


class _Head:
    def __init__(self, version):
        self.eagle_version = version


@pytest.fixture(scope="module")
def heads(tiny_pair, tmp_path_factory):
    """The tiny target with its EAGLE-3 head, with a random EAGLE-1 head, and alone."""
    base, head3 = tiny_pair
    head1 = tmp_path_factory.mktemp("eagle1") / "head"
    from transformers import AutoModelForCausalLM

    make_head(head1, AutoModelForCausalLM.from_pretrained(str(base)), eagle3=False, seed=3)
    tree = dict(total_token=10, depth=3, top_k=3, lookup_tokens=4, dtype=torch.float32)
    return {
        "eagle3": EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head3), **tree),
        "eagle1": EaModel.from_pretrained(use_eagle3=False, base_model_path=str(base), ea_model_path=str(head1),
                                          **tree),
        None: EaModel.from_pretrained(base_model_path=str(base), load_head=False),
    }


def _plain(model, prompt=PROMPT, tokens=16):
    return model.naivegenerate(torch.tensor([prompt]), max_new_tokens=tokens)[0].tolist()


# ------------------------------------------------------------------------------------------------ the registry
def test_the_registry_says_what_a_model_can_run():
    without = ["none", "lookup", "suffix", "suffix+lookup"]
    assert runnable_drafters(None) == without
    assert runnable_drafters(_Head(3)) == ["eagle3", "eagle3+lookup", "eagle3+suffix"] + without
    assert runnable_drafters(_Head(1)) == ["eagle1", "eagle1+lookup", "eagle1+suffix"] + without
    assert check_drafter("none+lookup", None) == "lookup" and check_drafter(" eagle3+lookup ", _Head(3)) == "eagle3+lookup"


def test_bad_drafters_say_why_and_what_would_run():
    with pytest.raises(ValueError, match=r"Unknown drafter 'medusa'.*available: eagle1, eagle3, none, suffix and "
                                         r"the combinators \+lookup, \+suffix.*this model can run: eagle3, "
                                         r"eagle3\+lookup, eagle3\+suffix, none"):
        check_drafter("medusa", _Head(3))
    with pytest.raises(ValueError, match="Unknown drafter combinator 'cache'"):
        check_drafter("eagle3+cache", _Head(3))
    with pytest.raises(ValueError, match="drafts with an EAGLE-3 head, and this model was loaded without an EAGLE "
                                         "head; it can run: none, lookup, suffix"):
        check_drafter("eagle3+lookup", None)
    with pytest.raises(ValueError, match="needs an EAGLE-1 head, but this model's head is EAGLE-3"):
        check_drafter("eagle1", _Head(3))
    with pytest.raises(ValueError, match="needs an EAGLE-3 head, but this model's head is EAGLE-1"):
        check_drafter("eagle3", _Head(1))
    for spec in ("", None, 3):
        with pytest.raises(ValueError, match="A drafter must be a name"):
            check_drafter(spec, None)


def test_a_registered_drafter_is_runnable_and_combinable_where_its_head_allows():
    register_drafter("chain_t", lambda context: NoDrafter())
    try:
        assert {"chain_t", "chain_t+lookup"} <= set(runnable_drafters(None))
        register_drafter("chain_t", lambda context: NoDrafter(), head_version=3)
        assert "chain_t" not in runnable_drafters(None) and "chain_t" in runnable_drafters(_Head(3))
    finally:
        del DRAFTERS["chain_t"]
        HEAD_VERSIONS.pop("chain_t", None)


def test_the_reference_booleans_map_to_drafters():
    assert reference_drafter(None) is None
    assert reference_drafter(use_eagle=True) == HEAD and reference_drafter(use_eagle=False) == "none"
    assert reference_drafter("eagle3", use_eagle=True) == "eagle3"
    assert reference_drafter("none", use_eagle=False) == "none"
    with pytest.raises(ValueError, match="use_eagle=False contradicts drafter='eagle3'"):
        reference_drafter("eagle3", use_eagle=False)
    with pytest.raises(ValueError, match="use_eagle=True contradicts drafter='none'"):
        reference_drafter("none", use_eagle=True)
    assert reference_drafter("eagle1", use_eagle3=False) == "eagle1"
    with pytest.raises(ValueError, match="use_eagle3=True loads an EAGLE-3 head, which cannot run drafter='eagle1'"):
        reference_drafter("eagle1", use_eagle3=True)


# ------------------------------------------------------------------------------------------------ EaModel
@pytest.mark.parametrize("kind", ["eagle3", "eagle1", None])
def test_every_runnable_drafter_gives_plain_decodings_greedy_output(heads, kind):
    model = heads[kind]
    expected = _plain(model)
    assert model.runnable_drafters() == runnable_drafters(model.ea_layer)
    for drafter in model.runnable_drafters():
        ids = torch.tensor([PROMPT])
        assert model.generate(ids, max_new_tokens=16, drafter=drafter)[0].tolist() == expected, drafter
        assert model.eagenerate(ids, max_new_tokens=16, drafter=drafter)[0].tolist() == expected, drafter
        steps = list(model.generate_steps(ids, max_new_tokens=16, drafter=drafter))
        assert PROMPT + torch.cat([s.tokens for s in steps]).tolist() == expected, drafter
        if drafter == "none":
            assert all(step.accepted == 0 for step in steps)


def test_the_default_drafter_is_the_heads_own_and_use_eagle_is_its_alias(heads):
    assert heads["eagle3"].drafter == "eagle3+lookup" and heads["eagle1"].drafter == "eagle1+lookup"
    assert heads[None].drafter == "none"  # a model without a head decodes plainly by default
    model = heads["eagle3"]
    assert model.check_drafter() == model.check_drafter(use_eagle=True) == "eagle3+lookup"
    assert model.check_drafter(use_eagle=False) == "none"
    with pytest.raises(ValueError, match="no draft head"):
        heads[None].check_drafter(use_eagle=True)
    with pytest.raises(ValueError, match="use_eagle=False contradicts"):
        model.generate(torch.tensor([PROMPT]), max_new_tokens=2, drafter="eagle3", use_eagle=False)


def test_from_pretrained_drafter_sets_the_default_and_is_checked(tiny_pair):
    base, head = tiny_pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=10, depth=3,
                                    top_k=3, drafter="lookup")
    assert model.drafter == "lookup" and model.ea_layer is not None  # the head is loaded, for calls that name it
    expected = _plain(model)
    steps = list(model.generate_steps(torch.tensor([PROMPT]), max_new_tokens=16))
    assert PROMPT + torch.cat([s.tokens for s in steps]).tolist() == expected
    assert model.eagenerate(torch.tensor([PROMPT]), max_new_tokens=16)[0].tolist() == expected
    model.drafter = None
    assert model.drafter == "eagle3"
    with pytest.raises(ValueError, match="needs an EAGLE-1 head, but this model's head is EAGLE-3"):
        model.drafter = "eagle1"
    with pytest.raises(ValueError, match="Unknown drafter 'fast'"):  # before anything loads
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), drafter="fast")
    with pytest.raises(ValueError, match="loaded without an EAGLE head; it can run: none, lookup"):
        EaModel.from_pretrained(base_model_path=str(base), load_head=False, drafter="eagle3")
    with pytest.raises(ValueError, match="use_eagle3=True loads an EAGLE-3 head"):
        EaModel.from_pretrained(use_eagle3=True, base_model_path=str(base), ea_model_path=str(head),
                                drafter="eagle1")


@pytest.mark.e2e
def test_the_embedded_pair_runs_every_drafter_losslessly():
    model = EaModel.from_pretrained(drafter="eagle3+lookup")
    assert model.drafter == "eagle3+lookup" and model.runnable_drafters()[0] == "eagle3"
    ids = model.tokenizer("Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown",
                          return_tensors="pt").input_ids
    expected = model.naivegenerate(ids, max_new_tokens=24)[0].tolist()
    for drafter in model.runnable_drafters():
        assert model.eagenerate(ids, max_new_tokens=24, drafter=drafter)[0].tolist() == expected, drafter


# ------------------------------------------------------------------------------------------------ command lines
def test_the_drafter_flag_is_checked_when_parsed_and_reaches_the_loader(monkeypatch, capsys):
    import argparse

    from eagle import cli

    parser = argparse.ArgumentParser()
    cli.add_model_arguments(parser)
    assert parser.parse_args([]).drafter is None
    assert parser.parse_args(["--drafter", "none+lookup"]).drafter == "lookup"
    with pytest.raises(SystemExit):
        parser.parse_args(["--drafter", "fast"])
    assert "Unknown drafter 'fast'" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(EaModel, "from_pretrained", classmethod(lambda cls, **kwargs: calls.append(kwargs)))
    cli.load_model_from_args(parser.parse_args(["--drafter", "eagle1"]))
    assert calls[-1]["drafter"] == "eagle1" and calls[-1]["use_eagle3"] is False  # the drafter names the version


def test_the_server_flag_and_its_no_eagle_alias():
    from eagle.application.server import parse_args

    assert parse_args([]).drafter is None
    assert parse_args(["--drafter", "eagle3+lookup"]).drafter == "eagle3+lookup"
    assert parse_args(["--no-eagle"]).drafter == "none"
    with pytest.raises(SystemExit):
        parse_args(["--no-eagle", "--drafter", "eagle3"])


# ------------------------------------------------------------------------------------------------ the benchmark
def test_the_benchmark_takes_drafter_specs_as_methods():
    from eagle.evaluation import benchmark
    from eagle.evaluation.methods import BENCHMARK_METHODS, ENGINE, method_named

    names = "none,lookup,eagle3,eagle3+lookup,eagle,plain,hf_generate,eagle_gguf_int8,llamacpp_eagle3"
    methods = benchmark.parse_methods(names)
    assert methods == names.split(",")
    records = {name: method_named(name) for name in methods}
    assert [records[n].drafter for n in ("none", "lookup", "eagle3", "eagle3+lookup", "eagle", "plain")] == [
        "none", "lookup", "eagle3", "eagle3+lookup", HEAD, "none"]
    assert {n for n, m in records.items() if m.needs_head} == {"eagle3", "eagle3+lookup", "eagle",
                                                                 "eagle_gguf_int8", "llamacpp_eagle3"}
    assert {n for n, m in records.items() if m.drafts} == {"lookup", "eagle3", "eagle3+lookup", "eagle",
                                                           "eagle_gguf_int8"}
    assert records["eagle_gguf_int8"].numerics == "int8" and records["hf_generate"].runner != ENGINE
    assert len({m.name for m in BENCHMARK_METHODS}) == len(BENCHMARK_METHODS)
    with pytest.raises(SystemExit, match="unknown method .medusa.*eagle, plain.*a drafter on this engine .eagle1, eagle3"):
        benchmark.parse_methods("eagle,medusa")


def test_the_benchmark_runs_methods_named_by_drafter(tmp_path, tiny_pair):
    from eagle.evaluation import benchmark
    from eagle.evaluation.questions import find_mt_bench_file

    questions = find_mt_bench_file()
    results = benchmark.main([
        "--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file",
        str(questions), "--num-questions", "1", "--max-new-tokens", "6", "--total-token", "8", "--depth", "3",
        "--top-k", "4", "--lookup-tokens", "4", "--warmup", "0", "--methods", "none,lookup,eagle3,eagle3+lookup",
        "--output-dir", str(tmp_path / "bench")])
    assert list(results["methods"]) == ["none", "lookup", "eagle3", "eagle3+lookup"]
    assert results["reference_method"] == "none" and results["methods"]["none"]["tau"] is None
    assert results["greedy_check"]["identical"] == results["greedy_check"]["checked"] > 0
    assert results["methods"]["eagle3"]["tau"] >= 1.0
