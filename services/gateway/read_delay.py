"""How far behind a scheduler this gateway reads its messages (one ReadDelay per scheduler replica).

Each StepMessage carries the scheduler's wall clock when it was made. Its delay here (this clock minus
that stamp) is the two clocks' offset, the path's own latency, and the time the message waited because
this gateway was busy; the least delay seen lately stands for the first two, so a message's delay beyond
it is how far behind this gateway is. The least creeps up by DRIFT seconds per second, so that an offset
that changes (a clock stepped by NTP) is learnt again.
"""

import math

DRIFT = 0.01


class ReadDelay:
    def __init__(self) -> None:
        self._least = math.inf
        self._seen_at = 0.0

    def behind(self, made_at_unix_us: int, now: float) -> float:
        """Seconds the message made at `made_at_unix_us` (0: not stamped) waited beyond the least delay; `now`:
        this process's time.time()."""
        if not made_at_unix_us:
            return 0.0
        delay = now - made_at_unix_us / 1e6
        self._least = min(self._least + (now - self._seen_at) * DRIFT, delay)
        self._seen_at = now
        return delay - self._least
