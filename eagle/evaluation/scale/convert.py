"""Converting a widened pair (see :mod:`eagle.evaluation.scale.build`) into the files a CPU user runs: llama.cpp's
``convert_hf_to_gguf.py`` writes the model directory as an f16 (or bf16) GGUF, ``llama-quantize`` makes its
Q4_K_M (or another type), the f16 intermediate is deleted unless kept, and the widened head is exported to a
llama.cpp EAGLE-3 draft GGUF (:func:`eagle.export.write_llamacpp_gguf`).

Both tools come from the pinned llama.cpp that ``scripts/build_llama_cpp.sh`` unpacks and builds (its source holds
``convert_hf_to_gguf.py`` and its own gguf-py). The converter reads the safetensors shards lazily and writes tensor by
tensor, so its memory is about one tensor plus the pages of the memory-mapped shards it reads (file-backed,
reclaimable); the peak resident set of each step is logged. The converter's Python needs are the project's plus
``requirements-scale.txt`` (``pip install -r requirements-scale.txt``): it imports ``sentencepiece`` while reading
a Llama tokenizer, even a BPE one."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CONVERTER_MODULES = ("sentencepiece", "yaml")  # what convert_hf_to_gguf.py imports beyond the project's needs
OUTTYPES = ("f16", "bf16")
RECORD = "conversion.json"
INSTALL_HINT = "pip install -r requirements-scale.txt"
# Runs convert_hf_to_gguf.py (argv[1], its arguments after it) with two changes for a widened Qwen2 / Qwen2-MoE:
# - transformers' AutoTokenizer reads the directory's tokenizer.json as written. For a Qwen2 or Qwen2-MoE model type
#   transformers 5 builds Qwen2's own tokenizer (Qwen2's pre-tokenizer over the vocabulary) instead, whose
#   pre-tokenizer the converter does not recognise for SmolLM2's vocabulary; as written it is SmolLM2's ("smollm").
# - the shared expert's gate, (1, hidden) in transformers, is written as a vector, the shape llama.cpp's qwen2moe
#   reads ({n_embd}) and the one transformers' GGUF loader expects (it adds the leading 1; a (1, hidden) tensor
#   becomes (1, 1, hidden) there and the model does not load).
CONVERTER_SHIM = """
import os, runpy, sys, transformers
from transformers.tokenization_utils_tokenizers import TokenizersBackend
transformers.AutoTokenizer.from_pretrained = TokenizersBackend.from_pretrained
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
from conversion import qwen
modify = qwen.Qwen2MoeModel.modify_tensors
def modify_tensors(self, data, name, bid):
    if name.endswith("shared_expert_gate.weight"):
        data = data.reshape(-1)
    return modify(self, data, name, bid)
qwen.Qwen2MoeModel.modify_tensors = modify_tensors
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def find_converter() -> Path | None:
    """``convert_hf_to_gguf.py`` of the pinned llama.cpp source, or None."""
    from eagle.evaluation.llamacpp import llama_cpp_cache

    path = llama_cpp_cache() / "src" / "convert_hf_to_gguf.py"
    return path if path.is_file() else None


def find_llama_tool(name: str) -> Path | None:
    """A llama.cpp binary (``llama-quantize``, ``llama-batched-bench``) beside llama-server, or None."""
    from eagle.evaluation.llamacpp import find_llama_server

    server = find_llama_server()
    if server is None:
        return None
    path = Path(server).parent / name
    return path if path.is_file() and os.access(path, os.X_OK) else None


def missing_converter_modules() -> list[str]:
    """The Python modules ``convert_hf_to_gguf.py`` needs that are not installed."""
    return [name for name in CONVERTER_MODULES if importlib.util.find_spec(name) is None]


def conversion_problem() -> str | None:
    """Why the conversion cannot run here (one sentence), or None."""
    if find_converter() is None:
        from eagle.evaluation.llamacpp import llama_cpp_cache

        return (f"llama.cpp's convert_hf_to_gguf.py is not in {llama_cpp_cache() / 'src'}: run "
                "scripts/build_llama_cpp.sh")
    if find_llama_tool("llama-quantize") is None:
        return "llama-quantize is not built: run scripts/build_llama_cpp.sh (it builds the missing binary)"
    missing = missing_converter_modules()
    if missing:
        return f"convert_hf_to_gguf.py needs the Python module(s) {', '.join(missing)}: {INSTALL_HINT}"
    return None


def run_step(command: list[str], what: str) -> int:
    """Run one tool (its output passes through: the converter's progress bar, the quantizer's tensor lines);
    returns the peak resident set of the children so far in bytes. A failure raises a RuntimeError naming ``what``."""
    logger.info("%s: %s", what, " ".join(command))
    done = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if done.returncode:
        raise RuntimeError(f"{what} failed with exit code {done.returncode} (its output is above).")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    logger.info("%s done; peak resident memory of a tool so far %.2f GB", what, peak / 1e9)
    return peak


def gguf_names(out: Path, outtype: str, quant: str) -> dict[str, Path]:
    return {"intermediate": out / f"model-{outtype}.gguf", "model": out / f"model-{quant}.gguf",
            "head": out / "head-eagle3.gguf"}


def converted_files(out: str | os.PathLike, quant: str = "Q4_K_M") -> dict[str, Path]:
    """The converted files of a pair under ``out`` (``model``: the quantized GGUF, ``head``: the EAGLE-3 draft
    GGUF, ``head_dir``: the head directory); a FileNotFoundError says which step to run when one is missing."""
    out = Path(out).expanduser()
    files = {**{k: v for k, v in gguf_names(out, "f16", quant).items() if k != "intermediate"},
             "head_dir": out / "head"}
    for path in files.values():
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run `python -m eagle.evaluation.scale convert` (after "
                                    f"`build`) for this shape and --quant {quant} first.")
    return files


def convert_pair(out: str | os.PathLike, outtype: str = "f16", quant: str = "Q4_K_M", keep_intermediate: bool = False,
                 threads: int | None = None, force: bool = False) -> dict[str, Path]:
    """Convert the widened pair built under ``out`` (``out/model``, ``out/head``): ``out/model-<quant>.gguf`` and
    ``out/head-eagle3.gguf`` (and ``out/model-<outtype>.gguf`` when ``keep_intermediate``). Files already converted
    from the same pair with the same settings are kept unless ``force``. Returns the paths by role."""
    from eagle.export import write_llamacpp_gguf
    from eagle.evaluation.scale.build import RECORD as BUILT

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}.")
    out = Path(out).expanduser()
    if not (out / BUILT).is_file():
        raise FileNotFoundError(f"No widened pair is built in {out} (no {BUILT}): run `python -m "
                                "eagle.evaluation.scale build` for this shape first.")
    problem = conversion_problem()
    if problem:
        raise RuntimeError(f"Cannot convert {out}: {problem}.")
    paths = gguf_names(out, outtype, quant)
    record = {"pair": json.loads((out / BUILT).read_text()), "outtype": outtype, "quant": quant}
    done = out / RECORD
    previous = json.loads(done.read_text()) if done.is_file() else {}
    if not force and {k: previous.get(k) for k in record} == record and paths["model"].is_file() \
            and paths["head"].is_file() and (paths["intermediate"].is_file() or not keep_intermediate):
        logger.info("%s is already converted (%s)", out, paths["model"].name)
        return paths
    done.unlink(missing_ok=True)
    peaks = {}
    if force or previous.get("pair") != record["pair"] or not paths["intermediate"].is_file():  # none of this pair
        shim = [] if record["pair"].get("family", "llama") == "llama" else ["-c", CONVERTER_SHIM]
        peaks["convert"] = run_step([sys.executable, *shim, str(find_converter()), str(out / "model"), "--outtype",
                                     outtype, "--outfile", str(paths["intermediate"])], "convert_hf_to_gguf.py")
    peaks["quantize"] = run_step([str(find_llama_tool("llama-quantize")), str(paths["intermediate"]),
                                  str(paths["model"]), quant, str(threads or os.cpu_count() or 1)], "llama-quantize")
    if not keep_intermediate:
        paths["intermediate"].unlink()
        logger.info("Deleted the %s intermediate %s", outtype, paths["intermediate"].name)
    write_llamacpp_gguf(str(out / "head"), str(paths["model"]), str(paths["head"]))
    logger.info("Exported the head to llama.cpp's EAGLE-3 draft GGUF %s", paths["head"])
    done.write_text(json.dumps({**record, "peak_tool_resident_bytes": peaks}, indent=2) + "\n")
    return paths
