"""Structured output: a request with a json_schema, regex or ebnf constraint (SamplingParams.constraint) only
samples tokens that keep its output within the grammar's language, with xgrammar (the grammar engine SGLang and
vLLM use).

- Grammars (the server, in a worker thread: compiling blocks): compiles a constraint against the model's
  vocabulary and gives the request its matcher. The vocabulary is read as the server starts (prepare()), in
  a process of its own (seconds for a 250k-token vocabulary, and parsing tokenizer.json holds the GIL for
  all of them: in this process the server would not answer meanwhile), and kept in the cache directory for
  the next start, keyed by the tokenizer's files (VocabularyCache); xgrammar caches compiled grammars by
  their text, up to CACHE_BYTES.
- xgrammar's GrammarMatcher (Request.grammar): the request's position in its grammar, advanced by each token
  it samples (accept_tokens). Its stop tokens are the request's (eos and stop_token_ids), so once the output
  is complete only those remain and the engine ends the request on one, as on any stop token.
- TokenMask (the model runner's, engine thread): before sampling, each constrained row's allowed tokens as a
  bitmask filled on the host, applied on the logits' device: every other token gets -inf. Only the logits
  that are sampled are masked: logprobs stay the model's raw distribution.
"""

import hashlib
import logging
import re
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from services.common.cache_files import write_atomically
from services.common.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

CACHE_BYTES = 256 * 1024 * 1024  # compiled grammars kept for reuse (a small JSON schema's is ~10 kB)
# Whitespace characters allowed between two JSON elements: room to indent 7 levels by 4, not to loop on
# whitespace (which xgrammar's default, unbounded, lets a model do until max_new_tokens).
JSON_MAX_WHITESPACE = 32
VOCABULARY_READ_TIMEOUT_S = 300  # the reader child takes seconds; a hung one must not hold constrained requests
MAX_ERROR_CHARS = 400  # xgrammar's parse errors quote the whole input
# xgrammar's errors start with where in its C++ sources they were raised.
_ERROR_ORIGIN = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: .*? is false: )?")

ConstrainedRow = tuple[int, xgr.GrammarMatcher]  # a row of the step's logits and its request's matcher


class InvalidGrammar(ValueError):
    """A constraint xgrammar cannot compile; the message says why."""


# The files a Hugging Face tokenizer is read from: what the serialized vocabulary depends on.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


class VocabularyCache:
    """The vocabulary as xgrammar serializes it, in `directory` under a key of everything it depends on: the
    tokenizer files' bytes, the padded vocabulary size, the stop tokens and xgrammar's version. Written
    atomically, so that schedulers starting together never read half a file; a directory that cannot be
    written only costs the next start its read."""

    def __init__(self, directory: Path, model_dir: Path, vocab_size: int, eos_token_ids: list[int]):
        key = hashlib.sha256(f"{version('xgrammar')} {vocab_size} {eos_token_ids}".encode())
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                key.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
        self.path = directory / "xgrammar" / f"vocabulary-{key.hexdigest()[:32]}.json"

    def read(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:
            return None

    def write(self, serialized: str) -> None:
        try:
            write_atomically(self.path, serialized.encode())
        except OSError as exc:
            log.warning("structured output: could not keep the vocabulary in %s (%s); the next start reads it "
                        "again", self.path.parent, exc)


class Grammars:
    """Compiles constraints for one model: its tokenizer's vocabulary padded to the logits' size. `cache_dir`:
    where the vocabulary is kept between starts (None: not kept)."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int], cache_dir: Path | None = None):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._cache = VocabularyCache(cache_dir, model_dir, vocab_size, eos_token_ids) if cache_dir else None
        self._compiler: xgr.GrammarCompiler | None = None
        self._loading = threading.Lock()
        self._compile_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

    def prepare(self) -> Future[xgr.GrammarCompiler]:
        """Read the vocabulary now, in the compile thread, so that the first constrained request does not wait
        seconds for it (it waits only for what is left)."""
        reading = self._compile_thread.submit(self._compiler_now)
        reading.add_done_callback(_report_reading)
        return reading

    def _compiler_now(self) -> xgr.GrammarCompiler:
        with self._loading:
            if self._compiler is None:
                info = self._kept_vocabulary()
                if info is None:
                    serialized = self._read_vocabulary()
                    if self._cache is not None:
                        self._cache.write(serialized)
                    info = xgr.TokenizerInfo.deserialize_json(serialized)  # tens of milliseconds
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
                log.info("structured output: %s's vocabulary read for grammar compilation", self.model_dir)
            return self._compiler

    def _kept_vocabulary(self) -> xgr.TokenizerInfo | None:
        """The vocabulary kept by an earlier start; None when there is none, or none that xgrammar can read."""
        if self._cache is None or (serialized := self._cache.read()) is None:
            return None
        try:
            return xgr.TokenizerInfo.deserialize_json(serialized)
        except (RuntimeError, ValueError) as exc:  # damaged: read the tokenizer again, and keep that
            log.warning("structured output: the kept vocabulary %s is unreadable (%s); reading it again",
                        self._cache.path, str(exc)[:200])
            return None

    def _read_vocabulary(self) -> str:
        """read_tokenizer_info in a process of its own."""
        command = [sys.executable, "-m", __name__, str(self.model_dir), str(self.vocab_size),
                   *map(str, self.eos_token_ids)]
        try:
            reader = subprocess.run(command, capture_output=True, text=True, timeout=VOCABULARY_READ_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"reading {self.model_dir}'s vocabulary took over {VOCABULARY_READ_TIMEOUT_S} s") \
                from None
        if reader.returncode:
            raise RuntimeError(f"reading {self.model_dir}'s vocabulary failed: {reader.stderr.strip()[-2000:]}")
        return reader.stdout

    @staticmethod
    def parse(kind: str, text: str) -> xgr.Grammar:
        """The constraint as a grammar, or InvalidGrammar saying why not: under a millisecond, as the
        vocabulary plays no part (the compile against it does)."""
        try:
            if kind == "json_schema":
                return xgr.Grammar.from_json_schema(text, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            return xgr.Grammar.from_ebnf(text)
        except (RuntimeError, ValueError) as exc:
            message = _ERROR_ORIGIN.sub("", str(exc).strip()).strip()
            if len(message) > MAX_ERROR_CHARS:
                message = message[:MAX_ERROR_CHARS] + "..."
            raise InvalidGrammar(f"xgrammar cannot compile it: {message}") from None

    def matcher(self, grammar: xgr.Grammar, stop_ids: frozenset[int]) -> xgr.GrammarMatcher:
        """A new request's matcher: the grammar, then one of `stop_ids` (not empty). Blocking: reads the vocabulary
        the first time (seconds), then milliseconds for a small schema, nothing when cached."""
        compiled = self._compiler_now().compile_grammar(grammar)
        return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))

    def matcher_later(self, grammar: xgr.Grammar, stop_ids: frozenset[int]) -> Future[xgr.GrammarMatcher]:
        """matcher() in this model's compile thread: its Submit answers at once, and the request waits for it
        (RequestStatus.COMPILING), however long the compile takes on a busy host."""
        return self._compile_thread.submit(self.matcher, grammar, stop_ids)


class TokenMask:
    """The step's grammar masks: one bitmask row per logits row (ceil(vocab / 32) int32 words), allocated once
    on the host and, for another device, there too."""

    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.host = xgr.allocate_token_bitmask(num_rows, vocab_size)
        self.on_device = self.host
        if device.type != "cpu":
            self.host = self.host.pin_memory()
            self.on_device = torch.empty_like(self.host, device=device)

    def apply(self, logits: torch.Tensor, rows: list[ConstrainedRow]) -> torch.Tensor:
        """Sets the tokens each (row, matcher) does not allow to -inf in float32 `logits` [B, V], in place."""
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(self.host, row)
        if self.on_device is not self.host:
            count = max(row for row, _ in rows) + 1
            self.on_device[:count].copy_(self.host[:count], non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, self.on_device, vocab_size=self.vocab_size,
                                        indices=[row for row, _ in rows])
        return logits


def _report_reading(reading: Future) -> None:
    if reading.exception() is not None:  # a constrained request tries again, and fails with the reason
        log.error("structured output: reading the vocabulary failed: %s", reading.exception())


def accept_tokens(rows: list[ConstrainedRow], next_ids: np.ndarray) -> None:
    """Advance each constrained row's matcher by the token it sampled."""
    for row, matcher in rows:
        token = int(next_ids[row])
        if not matcher.accept_token(token):
            # The mask allows only tokens it accepts: a sampler that picks a masked token (every allowed one
            # scored 0) leaves the matcher where it was, so the rest of the output still follows the grammar.
            log.error("sampled token %d is outside its request's grammar; the output will not match it", token)


def read_tokenizer_info(model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> str:
    """The model's vocabulary as xgrammar reads it, serialized (Grammars runs this as a process of its own)."""
    tokenizer = load_tokenizer(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids or None)
    return info.serialize_json()


if __name__ == "__main__":  # python -m services.scheduler.sampling.grammar MODEL_DIR VOCAB_SIZE [EOS_ID...]
    sys.stdout.write(read_tokenizer_info(Path(sys.argv[1]), int(sys.argv[2]), [int(i) for i in sys.argv[3:]]))
