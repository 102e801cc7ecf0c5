"""The tree a widened head carries, tuned on the widened model's own costs: the widened head starts with the source
head's trees (tuned on SmolLM2-135M, whose k-token forward costs differ), so after conversion
``python -m eagle.evaluation.simulate --write-tree`` runs on the quantized widened GGUF on the kernels with the
widened head (``total_token=-1``'s search: costs measured on this machine, the head's acceptance on built-in
prompts) and writes the winner into the head's ``config.json`` under the kernels' tree key (``cpu-gguf`` for float32
activations, ``cpu-gguf-int8`` for int8). Trees under other keys stay the source head's."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def tune_head_tree(out: str | os.PathLike, quant: str = "Q4_K_M", numerics: str = "auto") -> dict:
    """Tune the tree of the widened head under ``out`` on its converted model (``numerics``: the kernels' activations,
    as ``--gguf-kernels``) and write it into the head; returns the tree."""
    from eagle.evaluation import simulate
    from eagle.evaluation.scale.convert import converted_files

    files = converted_files(Path(out), quant)
    logger.info("Tuning the tree of %s on %s (%s activations)", files["head_dir"], files["model"].name, numerics)
    return simulate.main(["--base-model-path", str(files["model"]), "--use-eagle3", "--gguf-kernels", numerics,
                          "--write-tree", str(files["head_dir"])])[0]
