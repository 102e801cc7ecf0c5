"""The reference's import path ``eagle.model.choices``: see :mod:`eagle.model.compat.choices`."""

from eagle.model.compat.choices import *  # noqa: F401,F403
from eagle.model.compat.choices import __all__  # noqa: F401
