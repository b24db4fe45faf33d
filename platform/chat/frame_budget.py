"""How many frames one chat socket may send: a token bucket per socket.

Every frame costs the server something (most a database read or write, ``sync`` a read of the
whole conversation), and a page sends a few a minute: one per click or changed setting, one
``sync`` per connect. A client sending hundreds a second is not a page; its frames beyond the
budget are refused without being read, so one socket cannot keep the database busy for the
others.
"""

import math
import time
from collections.abc import Callable

# a page's bursts (a reconnect's sync, a send, a settings change, a stop) fit in BURST; a
# client may go on at PER_SECOND for good
FRAMES_PER_SECOND = 5.0
FRAME_BURST = 20


class FrameBudget:
    """``burst`` frames at once, then ``per_second`` frames a second."""

    def __init__(
        self,
        per_second: float | None = None,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_second = FRAMES_PER_SECOND if per_second is None else per_second
        self.burst = FRAME_BURST if burst is None else burst
        self._clock = clock
        self._tokens = float(self.burst)
        self._updated = clock()
        self._refused_since: float | None = None

    def take(self) -> float:
        """0 when a frame may be handled now (and counts it); else the seconds until one may."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.per_second)
        self._updated = now
        if self._tokens >= 1:
            self._tokens -= 1
            self._refused_since = None
            return 0.0
        return (1 - self._tokens) / self.per_second

    def first_refusal(self) -> bool:
        """True for the first frame refused since the last one handled: only it is answered,
        so that a flood of frames does not become a flood of errors."""
        if self._refused_since is not None:
            return False
        self._refused_since = self._clock()
        return True


def retry_after_seconds(wait: float) -> int:
    """Whole seconds, at least 1, as the page's banner counts them."""
    return max(1, math.ceil(wait))
