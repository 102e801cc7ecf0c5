"""The reference's import path ``eagle.model.utils``: see :mod:`eagle.model.compat.utils`."""

from eagle.model.compat.utils import *  # noqa: F401,F403
from eagle.model.compat.utils import __all__  # noqa: F401
