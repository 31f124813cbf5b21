"""Stop strings of one request: find the first match, trim, and hold back partial matches."""

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    start: int  # where the matched string begins in the text
    stop: str  # the matched stop string


@dataclass(frozen=True)
class StopStrings:
    strings: tuple[str, ...]  # non-empty strings only
    no_stop_trim: bool = False  # SGLang's: the text is not cut at a match
    include_stop: bool = False  # vLLM's include_stop_str_in_output: cut after the matched string, not before

    @classmethod
    def of(cls, strings, no_stop_trim: bool = False, include_stop: bool = False) -> "StopStrings":
        return cls(tuple(s for s in strings if s), no_stop_trim, include_stop)

    @property
    def keeps_stop_token(self) -> bool:
        """A stop token's text is part of the output (SGLang leaves it out unless no_stop_trim; vLLM's
        include_stop_str_in_output keeps it)."""
        return self.no_stop_trim or self.include_stop

    @property
    def max_len(self) -> int:
        return max(map(len, self.strings), default=0)

    def find(self, text: str, searched: int) -> StopMatch | None:
        """The earliest match in text (list order breaks ties).

        text[:searched] was searched before, so only the tail where a match could
        newly end is scanned: a match must end after `searched`.
        """
        start = max(0, searched - self.max_len + 1)
        best = None
        for stop in self.strings:
            pos = text.find(stop, start)
            if pos != -1 and (best is None or pos < best.start):
                best = StopMatch(pos, stop)
        return best

    def text_end(self, text: str, match: StopMatch) -> int:
        """Length of the text the request ends with: up to the match, through it with include_stop, or all of it
        with no_stop_trim."""
        if self.no_stop_trim:
            return len(text)
        return match.start + len(match.stop) if self.include_stop else match.start

    def partial_len(self, text: str, end: int) -> int:
        """Length of the longest suffix of text[:end] that begins some stop string.

        Streaming holds it back, so that text later trimmed is never sent; with
        no_stop_trim or include_stop no text before a match is trimmed, so nothing needs holding back.
        """
        if self.no_stop_trim or self.include_stop:
            return 0
        longest = 0
        for stop in self.strings:
            for size in range(min(len(stop) - 1, end), longest, -1):
                if text.endswith(stop[:size], 0, end):
                    longest = size
                    break
        return longest
