"""The repository cites only files it holds: every path in backticks in README.md, docs/, bench/README.md,
BENCHMARKS.md and RELIABILITY.md, and every path in a docstring, comment or string of the code, tests, benchmarks
and configuration (pyproject.toml, the Dockerfile, compose and Kubernetes files, CI), names a tracked file or
folder. A path relative to some folder counts (as `engine/policy.py` in docs/architecture.md)."""

import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md", "bench/README.md", *sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
CITED_PATH = re.compile(r"`([\w.\-/]+(?:\.(?:py|md|proto|yml|yaml|toml|json|txt|sh|png|jinja)|/))(?::[\w.]+)?`")
# In code and configuration, without backticks: a file of these kinds, or a folder (with a slash inside or at
# its end), as a word of its own.
PATH_WORD = re.compile(r"(?<![\w./$-])((?:[\w-][\w.-]*/)*[\w-][\w.-]*\.(?:py|md|proto|yml|yaml|toml|sh)"
                       r"|(?:[\w-][\w.-]*/)+)(?![\w/-])")
CODE = (".py", ".toml", ".yml", ".yaml", ".sh")
CONFIG = ("Dockerfile", ".ci/run")
GENERATED = "services/wire/flatwire_wire/pb/"  # protoc's output: what it cites is the protos' layout
# Not this repository's: HTTP routes, a checkpoint's own files and a Hub cache's folders, other projects' sources,
# benchmark and device-run output (generated), the example paths of usage texts, a capacity figure's "f4/".
NOT_OURS = ("/", "sglang/", "openai/", "vllm/", "skyrl/", "prime_rl/", "trl/", "slime/", "miles/", "areal/",
            "nemo_rl/", "verl/", "python/sglang/", "tokenizer.json", "vocab.json", "merges.txt", "original/", "onnx/",
            "snapshots/", "bench/out/", "bench/gpu/RESULTS.md", "path/to/", "file.py", "f4/")


def tracked() -> set[str]:
    """Every tracked (or new, not ignored) file, and every folder that holds one (with a trailing slash)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    folders = {"/".join(path.split("/")[:depth]) + "/" for path in listed for depth in range(1, path.count("/") + 1)}
    return set(listed) | folders


KNOWN = tracked()


def missing(paths: list[str]) -> list[str]:
    return [path for path in paths if not path.startswith(NOT_OURS) and path not in KNOWN
            and not any(entry.endswith("/" + path) for entry in KNOWN)]


def prose(path: Path) -> Iterator[str]:
    """A Python file's comments and prose strings (docstrings, messages: a string of one word is data, such as
    the name of a file the code writes); any other file's lines."""
    text = path.read_text(errors="replace")
    if path.suffix != ".py":
        yield from text.splitlines()
        return
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and " " in token.string):
            yield token.string


@pytest.mark.parametrize("doc", DOCS)
def test_cited_paths_exist(doc):
    cited = missing(CITED_PATH.findall((ROOT / doc).read_text()))
    assert not cited, f"{doc} cites what the repository does not hold: {cited}"


def test_paths_in_code_and_configuration_exist():
    sources = sorted(path for path in KNOWN if (path.endswith(CODE) or path in CONFIG or path.startswith(
        "deploy/")) and not path.endswith("/") and not path.startswith(GENERATED) and (ROOT / path).is_file())
    stale = {source: cited for source in sources
             if (cited := missing([word for text in prose(ROOT / source) for word in PATH_WORD.findall(text)]))}
    assert not stale, f"code and configuration cite what the repository does not hold: {stale}"
