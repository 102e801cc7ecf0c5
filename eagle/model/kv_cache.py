"""The reference's import path ``eagle.model.kv_cache``: see :mod:`eagle.model.compat.kv_cache`."""

from eagle.model.compat.kv_cache import *  # noqa: F401,F403
from eagle.model.compat.kv_cache import __all__  # noqa: F401
