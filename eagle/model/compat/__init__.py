"""The reference's public modules (``cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``, ``kv_cache``), in the
reference's names, over this package's engine. Each is importable from its reference path (``eagle.model.cnets``...)
through a one-line re-export; nothing in the engine imports them."""
