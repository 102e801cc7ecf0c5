"""Reference-compatibility layer: ``from eagle.model.cnets1 import Model``, the EAGLE-1/EAGLE-2 draft head.

The reference's import paths (``eagle.model.cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``, ``kv_cache``)
are thin re-exports of the modules of this package (:mod:`eagle.model.compat`); the engine never imports them
(tests/test_reference_api.py checks it).
The head is :class:`eagle.model.heads.draft_head.Eagle1DraftHead`.
"""

from eagle.model.heads.draft_head import Eagle1DraftHead
from eagle.model.heads.draft_layers import Eagle1DecoderLayer

Model = Eagle1DraftHead

__all__ = ["Model", "Eagle1DraftHead", "Eagle1DecoderLayer"]
