"""The one scanning step the streaming parsers share: find a marker in text that arrives in pieces."""


def split_at_marker(text: str, marker: str) -> tuple[str, str | None, str]:
    """(before, found, held): `before` is safe to hand on; `found` is the marker if it is in `text` (and
    `held` what follows it), else None and `held` the tail that may be the marker's start, kept for the
    next piece."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], marker, text[at + len(marker):]
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return text[:-keep], None, text[-keep:]
    return text, None, ""


class TrimmedStream:
    """Text handed on in pieces without its trailing whitespace (and, with `strip_leading`, its leading
    whitespace): trailing whitespace is held until more text follows it, so that a piece is never taken back."""

    def __init__(self, strip_leading: bool):
        self._leading = strip_leading
        self._space = ""

    def feed(self, text: str) -> str:
        if self._leading:
            text = text.lstrip()
            if not text:
                return ""
            self._leading = False
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out, self._space = self._space + body, text[len(body):]
        return out

    def end(self, keep_trailing: bool) -> str:
        """What is still held: the trailing whitespace if kept, else nothing."""
        held, self._space = self._space, ""
        return held if keep_trailing else ""
