"""Reference-compatibility layer: ``from eagle.model.configs import EConfig``, the draft head's configuration.

The reference's import paths (``eagle.model.cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``) live in these
five modules and nowhere else; the engine never imports them (tests/test_reference_api.py checks it).
The class lives in :mod:`eagle.model.draft_config`.
"""

from .draft_config import EConfig

__all__ = ["EConfig"]
