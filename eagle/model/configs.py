"""The reference's import path ``eagle.model.configs``: see :mod:`eagle.model.compat.configs`."""

from eagle.model.compat.configs import *  # noqa: F401,F403
from eagle.model.compat.configs import __all__  # noqa: F401
