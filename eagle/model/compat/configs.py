"""Reference-compatibility layer: ``from eagle.model.configs import EConfig``, the draft head's configuration.

The reference's import paths (``eagle.model.cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``, ``kv_cache``)
are thin re-exports of the modules of this package (:mod:`eagle.model.compat`); the engine never imports them
(tests/test_reference_api.py checks it).
The class lives in :mod:`eagle.model.heads.draft_config`.
"""

from eagle.model.heads.draft_config import EConfig

__all__ = ["EConfig"]
