"""lm-evaluation-harness (the pinned test-only dependency ``lm_eval``) as a real client of the OpenAI server: its
``local-completions`` model runs a small local task pair that the test writes (a log-likelihood multiple-choice task,
scored with ``echo: true, logprobs: 1``, and a ``generate_until`` task) against the server on the embedded pair,
once with EAGLE and once in plain decoding; both runs end, and their scores, log-likelihoods and generations are
equal."""

from __future__ import annotations

import json
import logging

import pytest

lm_eval = pytest.importorskip("lm_eval")

from eagle.application.server import BackgroundServer, create_app  # noqa: E402
from eagle.cli import load_default_model  # noqa: E402

pytestmark = pytest.mark.e2e  # the embedded SmolLM2 pair behind the HTTP server

NAME = "eagle-harness"
CHOICES = [
    ("The capital of France is", [" Paris", " London", " Berlin"], 0),
    ("Two plus two equals", [" five", " four", " twenty-two"], 1),
    ("The opposite of hot is", [" blue", " warm", " cold"], 2),
    ("The day after Monday is", [" Tuesday", " Sunday", " Friday"], 0),
]
QUESTIONS = [
    ("Q: What is the capital of Italy?\nA:", "Rome"),
    ("Q: How many legs does a spider have?\nA:", "Eight"),
    ("Q: What colour is the sky on a clear day?\nA:", "Blue"),
]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
doc_to_text: "{{{{question}}}}"
"""
MC_TASK = """output_type: multiple_choice
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """output_type: generate_until
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


@pytest.fixture(scope="module")
def model():
    return load_default_model()


def write_tasks(directory) -> None:
    """The two tasks' YAML configs and JSONL datasets in ``directory``."""
    mc, gen = directory / "mc.jsonl", directory / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in CHOICES))
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    cache = directory / "datasets-cache"
    (directory / "eagle_mc.yaml").write_text(TASK.format(name="eagle_mc", data=mc, cache=cache) + MC_TASK)
    (directory / "eagle_gen.yaml").write_text(TASK.format(name="eagle_gen", data=gen, cache=cache) + GEN_TASK)


def evaluate(model, tasks_dir, tokenizer_dir, **server_settings) -> dict:
    """The harness's results for both tasks against a server on ``model``."""
    from lm_eval.tasks import TaskManager

    app = create_app(model, served_model_name=NAME, max_batch_size=1, **server_settings)
    with BackgroundServer(app) as server:
        return lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": NAME, "base_url": server.url + "/v1/completions", "tokenizer": str(tokenizer_dir),
                        "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
                        "max_length": 2048},
            tasks=["eagle_mc", "eagle_gen"],
            task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),  # ours alone: quick
            bootstrap_iters=0, log_samples=True, random_seed=0)


def answers(results: dict, task: str) -> list:
    """Each request's answer: (log-likelihood, greedy) pairs, or generated texts."""
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_the_harness_scores_eagle_and_plain_decoding_the_same(model, tmp_path):
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    write_tasks(tmp_path)
    model.tokenizer.save_pretrained(tmp_path / "tokenizer")
    eagle = evaluate(model, tmp_path, tmp_path / "tokenizer")
    plain = evaluate(model, tmp_path, tmp_path / "tokenizer", drafter="none")
    for task, metric, count in (("eagle_mc", "acc,none", len(CHOICES)), ("eagle_gen", "exact_match,none",
                                                                        len(QUESTIONS))):
        assert len(eagle["samples"][task]) == count  # every example ran to the end
        assert eagle["results"][task][metric] == plain["results"][task][metric]
        assert answers(eagle, task) == answers(plain, task)
    loglikelihoods = [resp[0][0] for sample in answers(eagle, "eagle_mc") for resp in sample]
    assert len(loglikelihoods) == sum(len(c) for _, c, _ in CHOICES)
    assert all(isinstance(value, float) and value < 0 for value in loglikelihoods)
    assert eagle["results"]["eagle_mc"]["acc,none"] >= 0.5  # the model knows some of these: real scores
    generated = [sample[0][0] for sample in answers(eagle, "eagle_gen")]
    assert all(isinstance(text, str) for text in generated) and any(text.strip() for text in generated)
