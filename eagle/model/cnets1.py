"""The reference's import path ``eagle.model.cnets1``: see :mod:`eagle.model.compat.cnets1`."""

from eagle.model.compat.cnets1 import *  # noqa: F401,F403
from eagle.model.compat.cnets1 import __all__  # noqa: F401
