"""Reading JSONL files (one JSON value per line; blank lines skipped), the one reader of every command."""

from __future__ import annotations

import json
from collections.abc import Iterator


def read_jsonl(path: str, *, skip_bad_lines: bool = False) -> Iterator[tuple[int, object]]:
    """``(line number, value)`` for each non-blank line of ``path``. A line that is not valid JSON raises a
    ``ValueError`` naming the file and line, or is skipped with ``skip_bad_lines`` (a file being appended to whose
    last write was interrupted)."""
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line)
            except json.JSONDecodeError as err:
                if not skip_bad_lines:
                    raise ValueError(f"{path}, line {line_number}: not valid JSON ({err}).") from err
