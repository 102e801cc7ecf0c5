"""llama.cpp as benchmark methods: ``llamacpp`` (llama-server, plain decoding of the target's GGUF) and
``llamacpp_eagle3`` (the same server with our EAGLE-3 head exported by :mod:`eagle.export` as its draft,
``--spec-type draft-eagle3``), run on the same prompt token ids as the other methods.

llama-server is found through ``$EAGLE_LLAMA_CPP_BIN`` (a directory holding it), the cache directory that
``scripts/build_llama_cpp.sh`` builds into (``$EAGLE_LLAMA_CPP_CACHE``, default ``~/.cache/eagle/llama.cpp-11434``),
or ``PATH``. Each method's server starts once (127.0.0.1, a free port) and serves every question; a call is
timed around its HTTP request (prefill included, like the other methods). The prompt cache is off, so every
call processes its whole prompt. Acceptance comes from the server's ``timings`` (``draft_n``,
``draft_n_accepted``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .methods import GREEDY_TEMPERATURE, Generation

logger = logging.getLogger(__name__)

LLAMACPP_METHODS = ("llamacpp", "llamacpp_eagle3")
DEFAULT_CACHE = Path.home() / ".cache" / "eagle" / "llama.cpp-11434"
BUILD_HINT = "build it with scripts/build_llama_cpp.sh (about 15-40 minutes on 2 cores), or set EAGLE_LLAMA_CPP_BIN"


def llama_cpp_cache() -> Path:
    """The directory ``scripts/build_llama_cpp.sh`` builds llama.cpp in: ``$EAGLE_LLAMA_CPP_CACHE``, else
    :data:`DEFAULT_CACHE`."""
    return Path(os.environ.get("EAGLE_LLAMA_CPP_CACHE") or DEFAULT_CACHE)


def find_llama_server() -> str | None:
    """Path of a llama-server binary, or None."""
    candidates = []
    if os.environ.get("EAGLE_LLAMA_CPP_BIN"):
        candidates.append(Path(os.environ["EAGLE_LLAMA_CPP_BIN"]) / "llama-server")
    candidates.append(llama_cpp_cache() / "build" / "bin" / "llama-server")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("llama-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on 127.0.0.1 serving ``model`` (and ``draft``, an EAGLE-3 GGUF, when given)."""

    def __init__(self, binary: str, model: str, draft: str | None = None, draft_tokens: int = 3,
                 threads: int | None = None, context: int = 4096, timeout_s: float = 300.0,
                 extra_args: list[str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(context),
                   "-np", "1", "--no-warmup", "-t", str(threads or max(1, os.cpu_count() or 1))]
        if draft is not None:
            command += ["-md", draft, "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(draft_tokens)]
        command += list(extra_args or [])
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server did not become ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def complete(self, prompt: list[int] | str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 n_probs: int = 0) -> dict:
        """One ``/completion`` request on token ids (or text); returns the server's JSON answer. ``n_probs`` > 0 adds
        the target's ``n_probs`` likeliest tokens and their log-probabilities at every new token
        (``completion_probabilities``)."""
        body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": temperature, "seed": seed,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        if n_probs:
            body["n_probs"] = n_probs
        if temperature <= GREEDY_TEMPERATURE:
            body.update(top_k=1)
        else:  # the same distribution as the other methods: no top-k, top-p or min-p truncation
            body.update(top_k=0, top_p=1.0, min_p=0.0)
        request = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        os.unlink(self.log.name)


def timed_completion(server: LlamaServer, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                     seed: int) -> tuple[Generation, dict]:
    """One timed generation through ``server``: (Generation, the server's timings). llama.cpp does not return
    the end-of-generation token it stopped at, so an answer that ends there counts one token fewer than the
    same answer from the other methods."""
    start = time.perf_counter()
    answer = server.complete(prompt_ids, max_new_tokens, temperature, seed)
    wall_time = time.perf_counter() - start
    new_ids = [int(t) for t in answer.get("tokens", [])]
    timings = dict(answer.get("timings", {}), stop_type=answer.get("stop_type"))
    return Generation(new_ids, wall_time, forward_passes=None), timings


class LlamaCppMethods:
    """The llama.cpp methods of one benchmark run: starts the servers it needs, runs calls, closes them."""

    def __init__(self, methods: list[str], base_gguf: str, ea_model_path: str, threads: int | None = None,
                 draft_tokens: int = 3, context: int = 4096, extra_args: list[str] | None = None):
        binary = find_llama_server()
        if binary is None:
            raise FileNotFoundError(f"llama-server was not found: {BUILD_HINT}.")
        if not str(base_gguf).endswith(".gguf"):
            raise ValueError(f"The llama.cpp methods run the target's GGUF; --base-model-path is {base_gguf}.")
        self.draft_tokens, self.base_gguf, self.context = draft_tokens, str(base_gguf), context
        self.threads, self.extra_args = threads, list(extra_args or [])
        self.servers: dict[str, LlamaServer] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="eagle-llamacpp-")
        try:
            if "llamacpp" in methods:
                self.servers["llamacpp"] = LlamaServer(binary, base_gguf, threads=threads, context=context,
                                                       extra_args=extra_args)
            if "llamacpp_eagle3" in methods:
                from eagle.export import write_llamacpp_gguf

                draft = write_llamacpp_gguf(ea_model_path, base_gguf, os.path.join(self._tmp.name, "head.gguf"))
                self.servers["llamacpp_eagle3"] = LlamaServer(binary, base_gguf, draft=draft, threads=threads,
                                                              draft_tokens=draft_tokens, context=context,
                                                              extra_args=extra_args)
        except BaseException:
            self.close()
            raise
        self.binary = binary
        self.methods = tuple(self.servers)  # what ran, still known after close()

    def run(self, method: str, prompt_ids: list[int], max_new_tokens: int, temperature: float,
            seed: int) -> tuple[Generation, dict]:
        return timed_completion(self.servers[method], prompt_ids, max_new_tokens, temperature, seed)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers = {}
        self._tmp.cleanup()


def acceptance(timings: list[dict]) -> dict | None:
    """Drafted and accepted tokens summed over calls, and their ratio."""
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    accepted = sum(int(t.get("draft_n_accepted", 0)) for t in timings)
    if not drafted:
        return None
    return {"drafted": drafted, "accepted": accepted, "accepted_fraction": accepted / drafted}


def start_for_benchmark(methods: list[str], base_model_path: str, ea_model_path: str, threads: int | None,
                        draft_tokens: int, extra_args: list[str] | None = None
                        ) -> tuple[LlamaCppMethods | None, list[str], list[str]]:
    """(the llama.cpp methods or None, the methods that will run, notes). The llama.cpp methods are dropped with a
    note when llama-server is not built or the target is not a GGUF file; the other methods still run."""
    wanted = [m for m in methods if m in LLAMACPP_METHODS]
    if not wanted:
        return None, methods, []
    reason = None
    if find_llama_server() is None:
        reason = f"llama-server was not found ({BUILD_HINT})"
    elif not str(base_model_path).endswith(".gguf"):
        reason = "the target is not a GGUF file (llama.cpp runs GGUF targets)"
    if reason is None:
        try:
            llama = LlamaCppMethods(wanted, base_model_path, ea_model_path, threads=threads, draft_tokens=draft_tokens,
                                    extra_args=extra_args)
            return llama, methods, []
        except (RuntimeError, ValueError, OSError) as err:
            reason = f"llama-server failed to start: {err}"
    note = f"Skipped {', '.join(wanted)}: {reason}."
    logger.warning(note)
    return None, [m for m in methods if m not in LLAMACPP_METHODS], [note]


ONE_THREAD_PROBS = 10  # likeliest tokens whose log-probabilities the one-thread rerun asks for


def different_questions(outputs: dict) -> list:
    """Question ids whose answer with our head differs from llama.cpp's plain answer."""
    return [qid for qid, answers in outputs.items() if answers["llamacpp_eagle3"] != answers["llamacpp"]]


def recheck_with_one_thread(llama: LlamaCppMethods, outputs: dict, prompts: dict, max_new_tokens: int) -> dict | None:
    """Greedy answers with our head that differ from llama.cpp's plain ones with several threads, set against its
    plain decoding with one thread (untimed, after the timed calls; a server of its own).

    llama.cpp's one-token decoding, once more than 256 tokens are cached, computes attention in one part of the
    cached keys per thread and merges the parts (its CPU flash attention's split-KV path); a verification of a draft,
    several tokens at once, does not split. With one thread there is one part and its plain and speculative answers
    agree; with several its plain decoding computes differently and can part from the speculative one where the
    target's two best tokens nearly tie. Returns None with one thread or no difference; else per question: the first
    differing new token, whether the answer with our head equals the one-thread plain answer, and the two tokens'
    log-probability gap there in the one-thread run (None when either is not among its ``ONE_THREAD_PROBS``
    likeliest)."""
    from .agreement import first_difference

    if set(llama.methods) != set(LLAMACPP_METHODS) or (llama.threads or 1) == 1:
        return None
    differing = different_questions(outputs)
    if not differing:
        return None
    server = LlamaServer(llama.binary, llama.base_gguf, threads=1, context=llama.context,
                         extra_args=llama.extra_args)
    try:
        answers = {qid: server.complete(prompts[qid], max_new_tokens, n_probs=ONE_THREAD_PROBS) for qid in differing}
    finally:
        server.close()
    rows = []
    for qid in differing:
        ours, plain = outputs[qid]["llamacpp_eagle3"], outputs[qid]["llamacpp"]
        reference = [int(t) for t in answers[qid].get("tokens", [])]
        first = first_difference(plain, ours)
        gap, probs = None, answers[qid].get("completion_probabilities", [])
        if first < min(len(plain), len(ours), len(probs)) and reference[:first] == plain[:first]:
            top = {int(e["id"]): float(e["logprob"]) for e in probs[first].get("top_logprobs", [])}
            if plain[first] in top and ours[first] in top:
                gap = abs(top[plain[first]] - top[ours[first]])
        rows.append({"question_id": qid, "first_difference": first, "equals_one_thread_plain": ours == reference,
                     "logit_gap": gap})
    return {"threads": 1, "questions": rows}


def summarise(per_question: list[dict], outputs: dict, llama: LlamaCppMethods | None, notes: list[str],
              draft_tokens: int, one_thread: dict | None = None) -> dict | None:
    """llama.cpp's part of the results: its binary, draft length, acceptance, and whether its greedy answers with
    our head equal its plain ones with the same threads (and, for those that differ with several threads,
    ``one_thread``: :func:`recheck_with_one_thread`'s answer). None when no llama.cpp method was asked for."""
    if llama is None and not notes:
        return None
    section = {"notes": list(notes), "server": os.path.basename(llama.binary) if llama else None, "draft_tokens": draft_tokens,
               "threads": llama.threads if llama else None, "extra_args": llama.extra_args if llama else [],
               "acceptance": None, "greedy_check": None}
    if llama is None:
        return section
    if "llamacpp_eagle3" in llama.methods:
        section["acceptance"] = acceptance([q["methods"]["llamacpp_eagle3"]["llamacpp_timings"] for q in per_question])
    if set(llama.methods) == set(LLAMACPP_METHODS):
        different = different_questions({q["question_id"]: outputs[q["question_id"]] for q in per_question})
        section["greedy_check"] = {"checked": len(per_question), "identical": len(per_question) - len(different),
                                   "different_questions": different, "one_thread": one_thread}
    return section


def report_lines(section: dict | None, temperature: float) -> list[str]:
    """Markdown lines for the benchmark report."""
    if section is None:
        return []
    lines = ["", "## llama.cpp", ""]
    lines += [f"- {note}" for note in section["notes"]]
    if section["server"]:
        extra = " ".join(section.get("extra_args") or [])
        threads = section.get("threads")
        lines.append(f"- llama-server: `{os.path.basename(section['server'])}`, {threads} thread{'s' * (threads != 1)}"
                     + (f", extra arguments `{extra}`" if extra else "") + ", our head exported with "
                     f"`python -m eagle.export --format llama.cpp`, `--spec-type draft-eagle3 --spec-draft-n-max "
                     f"{section['draft_tokens']}`; timed around each HTTP request, prompt cache off.")
    acc = section["acceptance"]
    if acc:
        lines.append(f"- Drafted tokens accepted: {acc['accepted']} of {acc['drafted']} "
                     f"({acc['accepted_fraction']:.3f}).")
    check = section["greedy_check"]
    if check and temperature <= GREEDY_TEMPERATURE:
        threads = section.get("threads")
        same_threads = f" (both on {threads} thread{'s' * (threads != 1)})" if threads else ""
        lines.append(f"- Greedy answers with our head equal llama.cpp's plain ones{same_threads} on {check['identical']} "
                     f"of {check['checked']} questions"
                     + (f" (differ: {check['different_questions']})." if check["different_questions"] else "."))
        lines += _one_thread_lines(check.get("one_thread"))
    return lines


def _one_thread_lines(one_thread: dict | None) -> list[str]:
    if not one_thread:
        return []
    rows = one_thread["questions"]
    same = [r["question_id"] for r in rows if r["equals_one_thread_plain"]]
    where = "; ".join(f"question {r['question_id']}: new token {r['first_difference']}, log-probability gap "
                      + ("-" if r["logit_gap"] is None else f"{r['logit_gap']:.3f}") for r in rows)
    lines = [f"- Of those, {len(same)} of {len(rows)} equal llama.cpp's plain decoding with 1 thread"
             + (f" (not: {[r['question_id'] for r in rows if not r['equals_one_thread_plain']]})" if len(same) < len(rows)
                else "") + f". First differing token and the two tokens' gap in the 1-thread run: {where}."]
    lines.append("- llama.cpp's one-token decoding computes attention in one part of the cached keys per thread once "
                 "more than 256 tokens are cached, and merges the parts; its verification of a draft (several tokens "
                 "at once) does not split. With several threads its plain decoding therefore computes differently "
                 "from its speculative decoding and can part from it where the two best tokens nearly tie: an answer "
                 "with our head equal to the 1-thread plain one is what llama.cpp's own decoding gives.")
    return lines
