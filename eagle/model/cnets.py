"""The reference's import path ``eagle.model.cnets``: see :mod:`eagle.model.compat.cnets`."""

from eagle.model.compat.cnets import *  # noqa: F401,F403
from eagle.model.compat.cnets import __all__  # noqa: F401
