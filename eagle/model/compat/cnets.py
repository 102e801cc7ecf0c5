"""Reference-compatibility layer: ``from eagle.model.cnets import Model``, the EAGLE-3 draft head.

The reference's import paths (``eagle.model.cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``, ``kv_cache``)
are thin re-exports of the modules of this package (:mod:`eagle.model.compat`); the engine never imports them
(tests/test_reference_api.py checks it).
The head is :class:`eagle.model.heads.draft_head.Eagle3DraftHead`.
"""

from eagle.model.heads.draft_head import Eagle3DraftHead
from eagle.model.heads.draft_layers import Eagle3DecoderLayer

Model = Eagle3DraftHead

__all__ = ["Model", "Eagle3DraftHead", "Eagle3DecoderLayer"]
