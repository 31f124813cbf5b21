"""The docs cite only files the repository holds: every `path` in backticks in README.md, docs/, bench/README.md,
BENCHMARKS.md and RELIABILITY.md names a tracked file or folder (a path relative to some folder counts, as
`engine/scheduler.py` in docs/architecture.md)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md", "bench/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
CITED_PATH = re.compile(r"`([\w.\-/]+(?:\.(?:py|md|proto|yml|yaml|toml|json|txt|sh|png|jinja)|/))(?::[\w.]+)?`")
# Not this repository's: HTTP routes, a checkpoint's own files, SGLang's sources, benchmark output (generated).
NOT_OURS = ("/", "sglang/", "tokenizer.json", "vocab.json", "merges.txt", "bench/out/")


def tracked() -> tuple[set[str], set[str]]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    folders = {"/".join(path.split("/")[:depth]) + "/" for path in listed for depth in range(1, path.count("/") + 1)}
    return set(listed), folders


@pytest.mark.parametrize("doc", DOCS)
def test_cited_paths_exist(doc):
    files, folders = tracked()
    known = files | folders
    missing = [path for path in CITED_PATH.findall((ROOT / doc).read_text())
               if not path.startswith(NOT_OURS) and path not in known
               and not any(entry.endswith("/" + path) for entry in known)]
    assert not missing, f"{doc} cites what the repository does not hold: {missing}"
