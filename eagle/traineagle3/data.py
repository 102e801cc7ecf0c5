"""Training data: conversations -> token ids with the assistant-only loss mask, batching, and the draft
vocabulary map (``d2t``/``t2d``) built from assistant-token frequencies and cached per dataset and tokenizer."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from .chat import normalize_conversation, require_chat_template, tokenize_conversation
from .prompts import read_json_records

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    input_ids: torch.Tensor  # (S,) long
    loss_mask: torch.Tensor  # (S,) long, 1 = assistant token
    index: int = 0  # position in its dataset (key of the target-output cache)


@dataclass
class LoadReport:
    """What happened to the records of a data file."""

    path: str
    records: int = 0
    kept: int = 0
    too_long: int = 0
    no_assistant: int = 0
    malformed: int = 0

    def summary(self) -> str:
        return (
            f"{self.path}: {self.records} conversations, {self.kept} used; skipped {self.too_long} longer than "
            f"--max_len, {self.no_assistant} without an assistant answer, {self.malformed} malformed."
        )


class ConversationDataset(Dataset):
    """Tokenized conversations of a ShareGPT-style JSON/JSONL file.

    Conversations longer than ``max_len`` tokens are skipped (not truncated) and counted in ``report``, as
    are conversations without any assistant token and malformed records (with a warning naming the first)."""

    def __init__(self, path: str, tokenizer, max_len: int):
        require_chat_template(tokenizer)
        self.report = LoadReport(path)
        self.samples: list[Sample] = []
        records = read_json_records(path)
        self.report.records = len(records)
        for index, record in enumerate(records):
            try:
                messages = normalize_conversation(record)
            except ValueError as err:
                if self.report.malformed == 0:
                    logger.warning("%s, record %d skipped: %s", path, index, err)
                self.report.malformed += 1
                continue
            if not any(m["role"] == "assistant" for m in messages):
                self.report.no_assistant += 1
                continue
            tokenized = tokenize_conversation(tokenizer, messages)  # a template that cannot be split is fatal
            if len(tokenized.input_ids) > max_len:
                self.report.too_long += 1
                continue
            if sum(tokenized.loss_mask) == 0:
                self.report.no_assistant += 1
                continue
            self.samples.append(
                Sample(
                    torch.tensor(tokenized.input_ids, dtype=torch.long),
                    torch.tensor(tokenized.loss_mask, dtype=torch.long),
                    len(self.samples),
                )
            )
        self.report.kept = len(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]

    def num_tokens(self) -> int:
        return sum(len(sample.input_ids) for sample in self.samples)


def collate(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: ``input_ids`` (pad 0), ``attention_mask``, ``loss_mask`` (B, S); and
    ``index`` (B,), the samples' positions in their dataset."""
    width = max(len(sample.input_ids) for sample in samples)
    input_ids = torch.zeros((len(samples), width), dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample.input_ids)
        input_ids[row, :length] = sample.input_ids
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = sample.loss_mask
    index = torch.tensor([sample.index for sample in samples], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "index": index}


# -- draft vocabulary ---------------------------------------------------------------------------------------


def build_vocab_map(samples: list[Sample], vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(d2t, t2d, coverage)`` for a draft vocabulary of the ``draft_vocab_size`` most frequent assistant tokens.

    Ties and shortfalls (fewer distinct assistant tokens than ``draft_vocab_size``) are filled, in order, by
    the most frequent other tokens of the data, then by the smallest unused ids, so ``d2t`` always has
    ``draft_vocab_size`` entries. Draft index i maps to target id ``i + d2t[i]`` (ids sorted ascending);
    ``t2d[v]`` says whether target id v is in the draft vocabulary. ``coverage`` is the fraction of assistant
    tokens the draft vocabulary holds."""
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"--draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary ({vocab_size} tokens); "
            f"use at most {vocab_size} (equal means a full-vocabulary head)."
        )
    if draft_vocab_size < 1:
        raise ValueError(f"--draft_vocab_size must be at least 1, got {draft_vocab_size}.")
    assistant = torch.zeros(vocab_size, dtype=torch.long)
    everything = torch.zeros(vocab_size, dtype=torch.long)
    for sample in samples:
        ids = sample.input_ids
        if int(ids.max()) >= vocab_size:
            raise ValueError(f"Token id {int(ids.max())} in the data is outside the target's vocabulary ({vocab_size}).")
        everything += torch.bincount(ids, minlength=vocab_size)
        assistant += torch.bincount(ids[sample.loss_mask.bool()], minlength=vocab_size)
    # Rank by assistant count, then overall count, then id (stable sort on a combined key).
    order = sorted(range(vocab_size), key=lambda v: (-int(assistant[v]), -int(everything[v]), v))
    used = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.long)
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    total = int(assistant.sum())
    coverage = float(assistant[used].sum()) / total if total else 0.0
    distinct = int((assistant > 0).sum())
    if distinct < draft_vocab_size:
        logger.info(
            "Only %d distinct assistant tokens for a draft vocabulary of %d: filled with the most frequent other ids.",
            distinct, draft_vocab_size,
        )
    return d2t, t2d, coverage


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides token ids and the loss mask: vocabulary, special tokens and chat template."""
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))).encode())
    digest.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return digest.hexdigest()


def file_fingerprint(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "eagle", "vocab_maps")


def vocab_map_cache_path(cache_dir: str, data_path: str, tokenizer, vocab_size: int, draft_vocab_size: int, max_len: int) -> str:
    key = hashlib.sha256(
        f"{file_fingerprint(data_path)}|{tokenizer_fingerprint(tokenizer)}|{vocab_size}|{draft_vocab_size}|{max_len}".encode()
    ).hexdigest()[:32]
    return os.path.join(cache_dir, f"vocab_map_{key}.safetensors")


def load_or_build_vocab_map(
    dataset: ConversationDataset, tokenizer, vocab_size: int, draft_vocab_size: int, max_len: int, cache_dir: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached map for this data file, tokenizer and sizes, or a newly built (and cached) one."""
    from safetensors.torch import load_file, save_file

    path = vocab_map_cache_path(cache_dir, dataset.report.path, tokenizer, vocab_size, draft_vocab_size, max_len)
    if os.path.isfile(path):
        cached = load_file(path)
        logger.info("Draft vocabulary map read from the cache %s", path)
        return cached["d2t"], cached["t2d"]
    d2t, t2d, coverage = build_vocab_map(dataset.samples, vocab_size, draft_vocab_size)
    logger.info("Draft vocabulary of %d tokens covers %.2f%% of the assistant tokens.", draft_vocab_size, 100 * coverage)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    save_file({"d2t": d2t, "t2d": t2d}, tmp, metadata={"coverage": f"{coverage:.6f}", "data": dataset.report.path})
    os.replace(tmp, path)
    return d2t, t2d
