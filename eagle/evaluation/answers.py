"""Reading answer files (the JSONL the answer scripts write) for analysis."""

from __future__ import annotations

from dataclasses import dataclass, field

from eagle.utils.jsonl import read_jsonl


@dataclass
class AnswerStats:
    """Totals of one question's answer over all its choices and turns.

    ``forward_passes`` is Σ(idxs + 1); ``accept_lengths`` the per-step accepted lengths, in order (empty when
    the file has none, e.g. baselines or files written by the reference scripts).
    """

    question_id: object
    category: str | None
    new_tokens: int = 0
    wall_time: float = 0.0
    forward_passes: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


def read_answer_file(path: str) -> dict:
    """``question_id`` -> record of a JSONL answer file (the last record of a question wins)."""
    records = {}
    for line_number, record in read_jsonl(path):
        if not isinstance(record, dict) or "question_id" not in record or not isinstance(record.get("choices"), list):
            raise ValueError(f"{path}:{line_number}: expected an answer with 'question_id' and 'choices'.")
        records[record["question_id"]] = record
    if not records:
        raise ValueError(f"{path} has no answers.")
    return records


def answer_stats(record: dict, path: str = "") -> AnswerStats:
    """Sum a record's ``new_tokens``, ``wall_time`` and ``idxs + 1`` over choices and turns."""
    stats = AnswerStats(record["question_id"], record.get("category"))
    for choice in record["choices"]:
        try:
            new_tokens, wall_time = choice["new_tokens"], choice["wall_time"]
        except KeyError as err:
            raise ValueError(
                f"{path}: question {record['question_id']} has a choice without {err.args[0]!r}."
            ) from None
        stats.new_tokens += int(sum(new_tokens))
        stats.wall_time += float(sum(wall_time))
        stats.forward_passes += int(sum(int(i) + 1 for i in choice.get("idxs", [])))
        for per_turn in choice.get("accept_lengths", []):
            stats.accept_lengths.extend(int(a) for a in per_turn)
        stats.texts.extend(choice.get("turns", []))
    return stats
