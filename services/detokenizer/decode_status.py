"""Incremental detokenization of one request, as SGLang's DetokenizerManager does it.

Each step decodes two windows of the request's ids: surr..read (text already
confirmed) and surr..end (the same plus the new tokens). The difference is the new
text. It is confirmed, and the window slides, only when it does not end in U+FFFD:
a multi-byte character split across tokens decodes to U+FFFD until its last byte
arrives, so such text is held back. Unconfirmed text is streamed only up to a
word boundary (find_printable_text); everything is flushed when the request ends.
The surrogate window (a few tokens before the new ones) lets byte-level and
SentencePiece tokenizers decode leading spaces and merged bytes correctly.
"""

from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


def _is_cjk(char: str) -> bool:
    cp = ord(char)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def find_printable_text(text: str) -> str:
    """The prefix of unconfirmed text that is safe to stream: whole words, whole CJK characters."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(text[-1]):
        return text
    if len(text) > 1 and _is_cjk(text[-2]):
        return text[:-1]
    return text[:text.rfind(" ") + 1]


@dataclass
class DecodeStatus:
    """Where one request's incremental decode stands."""

    decoded_text: str = ""  # confirmed text
    decode_ids: list[int] = field(default_factory=list)  # every output id that counts as text
    surr_offset: int = 0  # start of the surrogate window
    read_offset: int = 0  # ids up to here are in decoded_text
    sent_offset: int = 0  # characters already streamed

    def surr_ids(self) -> list[int]:
        return self.decode_ids[self.surr_offset:self.read_offset]

    def read_ids(self) -> list[int]:
        return self.decode_ids[self.surr_offset:]

    def advance(self, surr_text: str, read_text: str) -> tuple[str, int]:
        """Fold in the decodes of surr_ids() and read_ids().

        Returns the whole text so far (confirmed plus pending) and the length of
        its prefix that may be streamed now if the request is not finished.
        """
        new_text = read_text[len(surr_text):]
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            self.decoded_text += new_text
            self.surr_offset = self.read_offset
            self.read_offset = len(self.decode_ids)
            return self.decoded_text, len(self.decoded_text)
        return self.decoded_text + new_text, len(self.decoded_text) + len(find_printable_text(new_text))

    def take(self, text: str, end: int) -> str:
        """The not yet streamed part of text[:end]; marks it streamed."""
        if end <= self.sent_offset:
            return ""
        delta = text[self.sent_offset:end]
        self.sent_offset = end
        return delta
