"""Reference-compatibility layer: the reference's static tree shapes (paths of top-k ranks).

The reference's import paths (``eagle.model.cnets``, ``cnets1``, ``configs``, ``choices``, ``utils``, ``kv_cache``)
are thin re-exports of the modules of this package (:mod:`eagle.model.compat`); the engine never imports them
(tests/test_reference_api.py checks it).
EAGLE-2/3 grow their trees dynamically (:mod:`eagle.model.drafting.eagle`); these are data only, read by nothing in the
engine.
"""

mc_sim_7b_63 = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]

__all__ = ["mc_sim_7b_63"]
