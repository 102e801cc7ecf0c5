"""The fewest tokens a text can become, for refusing a prompt that cannot fit without tokenizing it.

The rule: a tokenizer that keeps every character of its input (each one ends up inside some token) and whose
tokens each stand for at most ``K`` characters turns ``N`` characters into at least ``ceil(N / K)`` tokens. ``K`` is
the longest token string of the vocabulary (added tokens included) times the most characters a normalizer can fold
into one: a token's string is never shorter than the text it stands for (byte-level BPE writes one vocabulary
character per byte and a character is one byte or more; SentencePiece's ``▁`` stands for one space; a byte-fallback
token ``<0x41>`` for one byte; WordPiece's ``##`` prefix stands for nothing), and NFC / NFKC compose at most 4 code
points into one (the longest canonical decomposition, U+1F82, is 4 long; NFD, NFKD and lowercasing only expand).

A byte-level BPE without an unknown token drops the bytes missing from its vocabulary (SmolLM2's lacks six ASCII
control characters, U+0004, U+0006, U+0013, U+0014, U+0016 and U+001D, and bytes no UTF-8 text has): when only
ASCII bytes are missing, a character is dropped only if it is one of those, and every other character keeps a byte
inside some token; those characters are not counted (:attr:`CharacterBound.dropped`). A missing UTF-8
continuation byte (0x80-0xBF) could drop whole non-ASCII characters: no bound then.

The rule needs a fast (``tokenizers``) tokenizer none of whose parts drops characters or folds an unbounded run of
them into one token. :func:`character_bound` reads the tokenizer's pipeline and returns ``None`` (no bound: only
the request body limit bounds the prompt, which is tokenized off the event loop) when it finds any of:

* a normalizer that strips, removes accents or control characters, rewrites with a regular expression or a
  shorter string, or applies a precompiled character map (``Strip``, ``StripAccents``, ``BertNormalizer``,
  ``Nmt``, ``Precompiled``, ``Replace`` by a pattern longer than its replacement);
* a pre-tokenizer that drops what it splits on (``Whitespace``, ``WhitespaceSplit``, ``BertPreTokenizer``,
  ``CharDelimiterSplit``, ``Split`` / ``Punctuation`` with behaviour ``removed``);
* a model that maps a whole unknown word, or a run of unknown characters, to one token, or drops them
  (``WordLevel``, ``WordPiece``, ``Unigram`` without byte fallback, ``BPE`` without byte fallback that fuses
  unknown characters, or that has no unknown token and is not byte-level as described above);
* an added token that swallows the spaces beside it (``lstrip`` / ``rstrip``);
* anything it does not know.

The server also drops repeated BOS tokens at the start of a prompt (:func:`eagle.templates.encode_text`); a prompt
made of thousands of BOS strings is the one input the bound overcounts.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Most code points NFC / NFKC compose into one (the longest canonical decomposition; tested against unicodedata).
MAX_COMPOSED = 4

_SAFE_NORMALIZERS = {"Prepend": 1, "Lowercase": 1, "NFD": 1, "NFKD": 1, "NFC": MAX_COMPOSED, "NFKC": MAX_COMPOSED}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


@dataclass(frozen=True)
class CharacterBound:
    """A tokenizer's lower bound on tokens: no token stands for more than ``per_token`` characters, and only the
    characters of ``dropped`` may stand for none."""

    per_token: int
    dropped: str = ""

    def min_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can become."""
        kept = len(text) - sum(text.count(char) for char in self.dropped)
        return math.ceil(kept / self.per_token)


def character_bound(tokenizer) -> CharacterBound | None:
    """The :class:`CharacterBound` of ``tokenizer``, or ``None`` when its pipeline gives none (see the module
    docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pipeline = json.loads(backend.to_str())
        vocab = tokenizer.get_vocab()
    except Exception as err:  # noqa: BLE001 - an unusual tokenizer: no bound, the prompt is tokenized as it is
        logger.info("no character bound for this tokenizer (%s)", err)
        return None
    fold = _normalizer_fold(pipeline.get("normalizer"))
    dropped, reason = _dropped_characters(pipeline, vocab)
    reason = (reason or _pre_tokenizer_problem(pipeline.get("pre_tokenizer"))
              or _added_token_problem(pipeline.get("added_tokens") or []))
    if fold is None:
        reason = reason or f"its normalizer may drop characters: {pipeline.get('normalizer')}"
    if reason or not vocab:
        logger.info("no character bound for this tokenizer: %s", reason or "empty vocabulary")
        return None
    return CharacterBound(per_token=max(len(token) for token in vocab) * fold, dropped=dropped)


def _members(part: dict | None, key: str) -> list[dict]:
    """The parts of a pipeline step, ``Sequence`` steps flattened; [] for no step."""
    if part is None:
        return []
    if part.get("type") == "Sequence":
        return [member for inner in part.get(key, []) for member in _members(inner, key)]
    return [part]


def _normalizer_fold(normalizer: dict | None) -> int | None:
    """Most input characters the normalizer folds into one output character; None: it may drop characters."""
    fold = 1
    for part in _members(normalizer, "normalizers"):
        kind = part.get("type")
        if kind == "Replace":
            pattern = part.get("pattern") or {}
            if "String" not in pattern or len(part.get("content", "")) < len(pattern["String"]):
                return None
        elif kind in _SAFE_NORMALIZERS:
            fold = max(fold, _SAFE_NORMALIZERS[kind])
        else:
            return None
    return fold


def _pre_tokenizer_problem(pre_tokenizer: dict | None) -> str | None:
    for part in _members(pre_tokenizer, "pretokenizers"):
        kind = part.get("type")
        if kind not in _SAFE_PRE_TOKENIZERS or str(part.get("behavior", "")).lower() == "removed":
            return f"its pre-tokenizer {kind} may drop characters"
    return None


def _dropped_characters(pipeline: dict, vocab: dict) -> tuple[str, str | None]:
    """(the characters the model may drop, why it gives no bound) for the pipeline's model."""
    model = pipeline.get("model") or {}
    kind = model.get("type")
    if kind == "Unigram" and model.get("byte_fallback"):
        return "", None
    if kind != "BPE":
        return "", f"its {kind} model may map a whole unknown word to one token"
    if model.get("byte_fallback"):
        return "", None
    if model.get("unk_token") is not None:
        return "", "its BPE model fuses runs of unknown characters into one token" if model.get("fuse_unk") else None
    byte_level = any(part.get("type") == "ByteLevel"
                     for part in _members(pipeline.get("pre_tokenizer"), "pretokenizers"))
    if not byte_level:
        return "", "its BPE model drops the characters it does not know"
    missing = [byte for byte, char in _byte_level_chars().items() if char not in vocab]
    if any(byte >= 0x80 for byte in missing):
        return "", "its byte-level BPE lacks a UTF-8 continuation byte: it may drop whole characters"
    return "".join(chr(byte) for byte in missing), None


@functools.cache
def _byte_level_chars() -> dict[int, str]:
    """For the ASCII bytes and the UTF-8 continuation bytes (0x80-0xBF): the character byte-level pre-tokenizers
    write that byte as (read from the pre-tokenizer: U+0080 + k is the bytes C2, 80 + k)."""
    from tokenizers import pre_tokenizers

    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = {byte: level.pre_tokenize_str(chr(byte))[0][0] for byte in range(0x80)}
    chars.update({0x80 + k: level.pre_tokenize_str(chr(0x80 + k))[0][0][1] for k in range(0x40)})
    return chars


def _added_token_problem(added_tokens: list[dict]) -> str | None:
    for token in added_tokens:
        if token.get("lstrip") or token.get("rstrip"):
            return f"its added token {token.get('content')!r} swallows the spaces beside it"
    return None
