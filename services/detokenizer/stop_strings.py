"""Stop strings of one request: find the first match, trim, and hold back partial matches."""

from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    start: int  # where the matched string begins in the text
    stop: str  # the matched stop string


@dataclass(frozen=True)
class StopStrings:
    strings: tuple[str, ...]  # non-empty strings only
    no_stop_trim: bool = False

    @classmethod
    def of(cls, strings, no_stop_trim: bool = False) -> "StopStrings":
        return cls(tuple(s for s in strings if s), no_stop_trim)

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
        """Length of the text the request ends with: up to the match, or all of it with no_stop_trim."""
        return len(text) if self.no_stop_trim else match.start

    def partial_len(self, text: str, end: int) -> int:
        """Length of the longest suffix of text[:end] that begins some stop string.

        Streaming holds it back, so that text later trimmed is never sent; with
        no_stop_trim nothing is trimmed, so nothing needs holding back.
        """
        if self.no_stop_trim:
            return 0
        longest = 0
        for stop in self.strings:
            for size in range(min(len(stop) - 1, end), longest, -1):
                if text.endswith(stop[:size], 0, end):
                    longest = size
                    break
        return longest
