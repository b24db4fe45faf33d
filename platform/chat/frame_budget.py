"""How many frames one chat socket may send: a token bucket per socket.

Every frame costs the server something (most a database read or write, ``sync`` a read of the
whole conversation), and a page sends a few a minute: one per click, sent message or changed
setting (its settings wait for a pause in the typing or the sliding), one ``sync`` per connect.
A client sending hundreds a second is not a page; its frames past the budget are refused
unhandled, so one socket cannot keep the database busy for the others.

Stops have a budget of their own, so that a user's stop is never refused for the frames sent
before it.
"""

import math
import time
from collections.abc import Callable

# a page's bursts (a reconnect's sync, a send, a few settings, a rename) fit in FRAME_BURST;
# a client may go on at FRAMES_PER_SECOND for good
FRAMES_PER_SECOND = 5.0
FRAME_BURST = 20
STOPS_PER_SECOND = 2.0
STOP_BURST = 10


def now() -> float:
    """The budgets' clock (a test replaces it)."""
    return time.monotonic()


class FrameBudget:
    """``burst`` frames at once, then ``per_second`` frames a second."""

    def __init__(
        self,
        per_second: float | None = None,
        burst: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.per_second = FRAMES_PER_SECOND if per_second is None else per_second
        self.burst = FRAME_BURST if burst is None else burst
        self._clock = clock or (lambda: now())  # looked up at each call: a test replaces it
        self._tokens = float(self.burst)
        self._updated = self._clock()
        self._is_refusing = False

    @classmethod
    def for_stops(cls) -> "FrameBudget":
        return cls(STOPS_PER_SECOND, STOP_BURST)

    def take(self) -> float:
        """0 when a frame may be handled now (and counts it); else the seconds until one may."""
        moment = self._clock()
        self._tokens = min(self.burst, self._tokens + (moment - self._updated) * self.per_second)
        self._updated = moment
        if self._tokens >= 1:
            self._tokens -= 1
            self._is_refusing = False
            return 0.0
        return (1 - self._tokens) / self.per_second

    def first_refusal(self) -> bool:
        """True for the first frame refused since the last one handled: only it is answered,
        so that a flood of frames does not become a flood of errors."""
        if self._is_refusing:
            return False
        self._is_refusing = True
        return True


def retry_after_seconds(wait: float) -> int:
    """Whole seconds, at least 1, as the page's banner counts them."""
    return max(1, math.ceil(wait))
