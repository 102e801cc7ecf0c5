"""Greedy agreement: every method's tokens against a reference method's (Hugging Face ``generate`` when it ran), per
question, with each first difference told apart as a numerical near-tie or a real difference.

Two correct greedy decoders of the same weights can still part ways where the target's two best tokens have
(nearly) the same logit: a tree forward and a one-token forward add the same numbers in another order. So at the
first differing position the target is run once more, plainly (the prompt and the common prefix, one forward pass),
and the gap between the logits of the two tokens chosen decides: below the tolerance of the model's dtype it is a
near-tie; above it, or when one answer simply runs on past where the other stopped, a real difference.
"""

from __future__ import annotations

import torch

# Largest logit gap between the two tokens still called a numerical near-tie, by the model's dtype.
NEAR_TIE_LOGIT_GAP = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.125, torch.float16: 0.02}
IDENTICAL, NEAR_TIE, DIFFERS = "identical", "near-tie", "differs"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (``min(len)`` when one is a strict prefix), None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def logit_gap(hf_model, prompt_ids: torch.Tensor, prefix: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the target's next-token logits after ``prompt_ids`` (1, S) and ``prefix``: one plain
    forward pass, no cache."""
    ids = torch.cat([prompt_ids[0], torch.tensor(prefix, dtype=torch.long, device=prompt_ids.device)])[None]
    with torch.no_grad():
        logits = hf_model(ids).logits[0, -1].float()
    return float((logits[a] - logits[b]).abs())


def compare(reference: list[int], tokens: list[int], gap_at, tolerance: float) -> dict | None:
    """None when ``tokens`` equal ``reference``; else the first difference, its logit gap and its kind (near-tie
    when the gap is at most ``tolerance``). ``gap_at(prefix, a, b)`` gives the logit gap of tokens ``a`` and ``b``
    after the common ``prefix``; a length difference alone (one answer runs on) has no gap and differs."""
    first = first_difference(reference, tokens)
    if first is None:
        return None
    gap = None
    if first < min(len(reference), len(tokens)):
        gap = gap_at(reference[:first], reference[first], tokens[first])
    kind = NEAR_TIE if gap is not None and gap <= tolerance else DIFFERS
    return {"first_difference": first, "logit_gap": gap, "kind": kind}


def greedy_agreement(per_question: list[dict], outputs: dict, reference: str, gap_at, tolerance: float,
                     tokenizer) -> dict:
    """Compare every method's tokens with ``reference``'s on every question.

    ``outputs``: question id -> method -> new token ids; ``gap_at(question_index, prefix, a, b)`` -> logit gap.
    Returns ``checked`` (question x method pairs), ``identical``, ``near_ties``, ``differences``, ``per_question``
    (question id -> method -> identical / near-tie / differs) and ``mismatches`` (one row per difference)."""
    per_question_agreement, mismatches = {}, []
    for index, question in enumerate(per_question):
        qid = question["question_id"]
        answers = outputs[qid]
        row = {}
        for method, tokens in answers.items():
            if method == reference:
                continue
            found = compare(answers[reference], tokens, lambda prefix, a, b: gap_at(index, prefix, a, b), tolerance)
            row[method] = IDENTICAL if found is None else found["kind"]
            if found is None:
                continue
            mismatches.append(_mismatch_row(qid, method, found, answers[reference], tokens, tokenizer))
        per_question_agreement[qid] = row
    statuses = [status for row in per_question_agreement.values() for status in row.values()]
    return {
        "reference": reference,
        "tolerance": tolerance,
        "checked": len(statuses),
        "identical": statuses.count(IDENTICAL),
        "near_ties": statuses.count(NEAR_TIE),
        "differences": statuses.count(DIFFERS),
        "per_question": per_question_agreement,
        "mismatches": mismatches,
    }


def _mismatch_row(qid, method: str, found: dict, reference: list[int], tokens: list[int], tokenizer) -> dict:
    first = found["first_difference"]
    window = slice(max(0, first - 8), first + 16)
    return {
        "question_id": qid,
        "method": method,
        **found,
        "method_tokens": len(tokens),
        "reference_tokens": len(reference),
        "method_text": tokenizer.decode(tokens[window]),
        "reference_text": tokenizer.decode(reference[window]),
    }
