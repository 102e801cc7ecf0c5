"""Measure how strong the engine's tests are: apply one subtle bug (a "mutation") to the engine, run test files one
by one, report which of them fail (catch it), and put the code back.

    python scripts/mutation_check.py --list
    python scripts/mutation_check.py residual_unnormalised tests/test_sampling.py tests/test_rejection_sampler.py
    python scripts/mutation_check.py --root COPY_OF_THE_REPO greedy_row tests/test_generation.py

Run it on a scratch copy of the repository (``git worktree add``; ``--root``): the mutation is written into the
source while the tests run. Each file runs as its own ``pytest -q -x`` (a file stops at its first failure: we only
ask whether it catches the bug), with ``OMP_NUM_THREADS=1``. One JSON line per file. Results: docs/TESTING.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name: (file, original text, mutated text), or a list of them for code that has had several shapes (the first whose
# original text occurs exactly once is applied).
MUTATIONS = {
    # greedy verification reads the target's choice from the parent's row instead of the node's own
    "greedy_row": [
        ("eagle/model/engine/acceptance.py", "predicted = torch.stack([rows[row][nodes[row]] for row in walking]).argmax(-1)",
         "predicted = torch.stack([rows[row][max(nodes[row] - 1, 0)] for row in walking]).argmax(-1)"),
        ("eagle/model/engine/acceptance.py", "predicted = torch.stack([logits[row][nodes[row]] for row in walking]).argmax(-1)",
         "predicted = torch.stack([logits[row][max(nodes[row] - 1, 0)] for row in walking]).argmax(-1)"),
        ("eagle/model/engine/acceptance.py", "path, bonus = greedy_path(tree, lambda node: logits[node].argmax())",
         "path, bonus = greedy_path(tree, lambda node: logits[max(node - 1, 0)].argmax())"),
    ],
    # the residual is left unnormalised after a rejected sibling (the next sibling is accepted too rarely)
    "residual_unnormalised": ("eagle/model/engine/acceptance.py", "            residual = residual / total\n",
                              "            residual = residual\n"),
    # after rejections the bonus token is drawn from the full target distribution instead of the residual
    "bonus_from_target": [
        ("eagle/model/engine/acceptance.py", "        if accepted is None:\n            return path, residual",
         "        if accepted is None:\n            return path, probs"),
        ("eagle/model/engine/acceptance.py", "return torch.tensor(path, device=tree.tokens.device), sampler.draw(residual)",
         "return torch.tensor(path, device=tree.tokens.device), sampler.draw(probs)"),
    ],
    # cache compaction moves the accepted keys but leaves the values where they were
    "compaction_values": ("eagle/model/base/kv_cache.py",
                          "            self.values[:, :, start : start + positions.numel()] = self.values[:, :, positions]\n",
                          ""),
    # a reduced-vocabulary head maps draft ids to target ids with the offset alone
    "d2t_offset": [("eagle/model/heads/draft_head.py", "return ids + self.d2t[ids]", "return self.d2t[ids]"),
                   ("eagle/model/cnets.py", "return ids + self.d2t[ids]", "return self.d2t[ids]")],
    # the tree is verified under a causal mask: every node also sees the nodes before it that are not its ancestors
    "tree_mask_causal": ("eagle/model/base/target.py", "new_block = tree_mask.to(device)",
                         "new_block = torch.ones(length, length, dtype=torch.bool, device=device).tril_()"),
    # the head is fed the features of the tree's first nodes instead of the accepted path's
    "features_gather": [
        ("eagle/model/engine/acceptance.py",
         "features = tree_features[torch.arange(index.shape[0], device=index.device)[:, None], index]",
         "features = tree_features[:, : index.shape[1]]"),
        ("eagle/model/engine/verify.py", "features = tree_features[:, path.to(tree_features.device)]",
         "features = tree_features[:, : path.numel()]"),
    ],
}


def find_mutation(root: Path, name: str) -> tuple[Path, str, str]:
    """(source file, original text, mutated text) of the first shape of ``name`` found exactly once under ``root``."""
    shapes = MUTATIONS[name] if isinstance(MUTATIONS[name], list) else [MUTATIONS[name]]
    for relative, old, new in shapes:
        source = root / relative
        if source.is_file() and source.read_text().count(old) == 1:
            return source, old, new
    raise SystemExit(f"{name}: the code it changes was not found exactly once (the code moved: update MUTATIONS).")


def run_files(root: Path, files: list[str], name: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for test_file in files:
        start = time.time()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file],
                              cwd=root, env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        failed = [line.split(" ")[1] for line in lines if line.startswith(("FAILED", "ERROR"))]
        print(json.dumps({"mutation": name, "file": test_file, "caught": proc.returncode != 0,
                          "summary": lines[-1] if lines else "", "seconds": round(time.time() - start),
                          "failed": failed}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mutation", nargs="?", help=f"One of: {', '.join(MUTATIONS)}; 'none' runs the files as they are.")
    parser.add_argument("files", nargs="*", help="Test files, relative to --root.")
    parser.add_argument("--root", default=".", help="The checkout to mutate (a scratch copy).")
    parser.add_argument("--list", action="store_true", help="List the mutations and exit.")
    args = parser.parse_args(argv)
    if args.list or not args.mutation:
        for name in MUTATIONS:
            print(f"{name:<24}{find_mutation(Path(args.root).resolve(), name)[0].relative_to(Path(args.root).resolve())}")
        return 0
    if args.mutation != "none" and args.mutation not in MUTATIONS:
        parser.error(f"unknown mutation {args.mutation!r}; expected one of {', '.join(MUTATIONS)} or none")
    root = Path(args.root).resolve()
    if args.mutation == "none":
        run_files(root, args.files, "none")
        return 0
    source, old, new = find_mutation(root, args.mutation)
    original = source.read_text()
    source.write_text(original.replace(old, new))
    try:
        run_files(root, args.files, args.mutation)
    finally:
        source.write_text(original)
    return 0


if __name__ == "__main__":
    sys.exit(main())
