"""Reasoning split from the answer, as SGLang's --reasoning-parser names the formats.

Both formats put the reasoning in a `<think>...</think>` block before the answer: qwen3's models open it
themselves (no block, no reasoning: `enable_thinking: false` renders an empty one into the prompt), while
deepseek-r1's template opens it in the prompt, so the output starts inside it (a `<think>` the model writes
again is dropped), unless the prompt closed the block too (`enable_thinking: false` renders an empty one): then
the output is all answer. Reasoning that never closes (the output ran out) is all reasoning.
"""

import enum
from enum import StrEnum

from services.gateway.agents.text_scan import TrimmedStream, split_at_marker

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ReasoningParserName(StrEnum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek-r1"


class _Where(enum.Enum):
    BEFORE = "before"  # no text yet that says whether a block opens
    INSIDE = "inside"
    AFTER = "after"


class ThinkBlock:
    """One output's text, piece by piece -> (reasoning, answer) pieces: the reasoning stripped at both ends, the
    answer after a block at its start."""

    def __init__(self, parser: ReasoningParserName, prompt_closed_it: bool = False):
        """`prompt_closed_it`: the prompt ends with a closed block (prompt_closes_block); deepseek-r1's output
        then starts after it."""
        opened_by_prompt = parser is ReasoningParserName.DEEPSEEK_R1 and not prompt_closed_it
        closed_by_prompt = parser is ReasoningParserName.DEEPSEEK_R1 and prompt_closed_it
        self._where = _Where.INSIDE if opened_by_prompt else _Where.AFTER if closed_by_prompt else _Where.BEFORE
        self._may_reopen = opened_by_prompt
        self._held = ""
        self._reasoning = TrimmedStream(strip_leading=True)
        self._answer = TrimmedStream(strip_leading=False)  # an answer after a block: its leading space dropped

    @property
    def closed(self) -> bool:
        """Whether the reasoning is over (the block closed, or the output began without one)."""
        return self._where is _Where.AFTER

    def feed(self, text: str) -> tuple[str, str]:
        pending, self._held = self._held + text, ""
        if self._where is _Where.BEFORE or self._may_reopen:
            head = pending.lstrip()
            if head.startswith(THINK_OPEN):
                self._where, pending = _Where.INSIDE, head[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(head):  # nothing yet, or what may be the block's opening
                self._held = pending
                return "", ""
            elif self._where is _Where.BEFORE:
                self._where = _Where.AFTER
            self._may_reopen = False
        reasoning = ""
        if self._where is _Where.INSIDE:
            before, closed, pending = split_at_marker(pending, THINK_CLOSE)
            reasoning = self._reasoning.feed(before)
            if closed is None:
                self._held = pending
                return reasoning, ""
            self._where, self._answer = _Where.AFTER, TrimmedStream(strip_leading=True)
        return reasoning, self._answer.feed(pending)

    def end(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._where is _Where.BEFORE:  # a lone prefix of "<think>" was the answer after all
            return "", self._answer.feed(held) + self._answer.end(keep_trailing=True)
        if self._where is _Where.INSIDE:
            return self._reasoning.feed(held) + self._reasoning.end(keep_trailing=False), ""
        return "", self._answer.end(keep_trailing=True)


def prompt_closes_block(tokenizer, prompt_ids: list[int]) -> bool:
    """Whether the prompt ends with `</think>` (and whitespace): its own tokens, not the model's, closed the
    reasoning."""
    return tokenizer.decode(prompt_ids[-8:]).rstrip().endswith(THINK_CLOSE)
