"""What the generation loop emits: one :class:`RowStep` per row and target forward pass.

Every consumer reads the same type: ``EaModel``'s generation methods, the server's and the web UI's serving worker.
A row's last step carries why it ended (``finish_reason``), so nobody works it out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.model.engine.logprobs import TokenLogprobs

STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"
FINISH_REASONS = (STOP, LENGTH, CANCELLED)


@dataclass
class RowStep:
    """One row's part of a step: ``tokens`` (n,) the new tokens (accepted drafts, then the target's own token;
    truncated at a stop token or the row's budget), ``accepted`` how many came from accepted drafts (0 for the
    prefill's first token), and ``finish_reason`` on the row's last step: ``"stop"`` (it emitted a stop token,
    the last of ``tokens``), ``"length"`` (its token budget is spent) or ``"cancelled"`` (it was cancelled; no
    tokens); None while it goes on. ``logprobs``: the tokens' log-probabilities when the row asked for them
    (:mod:`eagle.model.engine.logprobs`), else None."""

    tokens: torch.Tensor
    accepted: int
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


#: The one-sequence name of :class:`RowStep` (``EaModel.generate_steps`` yields them).
Step = RowStep


@dataclass
class BatchStep:
    """One step of a batch of B rows, in the caller's row order: ``rows[b]`` is row b's :class:`RowStep` (empty
    tokens once it has finished, its ``finish_reason`` kept). ``tokens``, ``accepted``, ``finished`` and
    ``finish_reasons`` give one field for every row."""

    rows: list[RowStep]

    @property
    def tokens(self) -> list[torch.Tensor]:
        return [row.tokens for row in self.rows]

    @property
    def accepted(self) -> list[int]:
        return [row.accepted for row in self.rows]

    @property
    def finished(self) -> list[bool]:
        return [row.finished for row in self.rows]

    @property
    def finish_reasons(self) -> list[str | None]:
        return [row.finish_reason for row in self.rows]
