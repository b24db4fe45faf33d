"""Each web process keeps one ``AsyncEngineClient`` per engine endpoint and routes every
request to the least-loaded ready replica of its deployment.

Load is the replica's last reported running plus waiting requests plus what this process has
sent it since. The clients' heartbeats bring a fresh STATS every second, so routing waits for
the engine only on a client's first request or after it went quiet; a replica that did not
answer is not asked again for ``STATS_TTL_SECONDS``. zmq.asyncio sockets belong to one event
loop, so there is one pool per running loop.
"""

import asyncio
import contextlib
import time
import weakref
from collections import Counter
from collections.abc import Iterator

from inference_engine.client import AsyncEngineClient, EngineUnavailable

STATS_TTL_SECONDS = 2.5  # two heartbeats and a half
# a replica whose step has run this long is stalled: routed to only when every ready one is
# (a normal step takes milliseconds on a GPU, a long prompt's chunk seconds on a CPU)
STALLED_STEP_SECONDS = 15.0
STATS_TIMEOUT_SECONDS = 1.0
RETRY_SECONDS = 0.02


class NoReadyReplica(Exception):
    """No replica of the deployment answered as ready."""


class EnginePool:
    def __init__(self) -> None:
        self._clients: dict[str, AsyncEngineClient] = {}
        self._silent_since: dict[str, float] = {}  # endpoint -> when a STATS went unanswered
        self._in_flight: Counter[str] = Counter()

    def client(self, endpoint: str) -> AsyncEngineClient:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = AsyncEngineClient(endpoint)
        return client

    async def stats(self, endpoint: str, timeout: float = STATS_TIMEOUT_SECONDS):
        """The replica's STATS, or None when it does not answer within ``timeout``. A new
        client's socket takes a moment to connect, so a refused send is retried until then."""
        client = self.client(endpoint)
        deadline = time.monotonic() + timeout
        stats = None
        while stats is None and (left := deadline - time.monotonic()) > 0:
            try:
                stats = await client.stats(timeout=left)
            except EngineUnavailable:
                await asyncio.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))
        if stats is None:
            self._silent_since[endpoint] = time.monotonic()
        return stats

    async def _recent_stats(self, endpoint: str):
        stats, age = self.client(endpoint).latest_stats()
        if age < STATS_TTL_SECONDS:
            return stats
        silent_since = self._silent_since.get(endpoint)
        if silent_since is not None and time.monotonic() - silent_since < STATS_TTL_SECONDS:
            return None
        return await self.stats(endpoint)

    async def max_model_len(self, endpoint: str) -> int | None:
        stats = await self._recent_stats(endpoint)
        return stats.max_model_len if stats is not None and stats.max_model_len else None

    async def tool_call_parser(self, endpoints: list[str]) -> str | None:
        """How the deployment's model writes tool calls (``StatsResponse.tool_call_parser``,
        "" for no convention the API can read), as its replicas last said; None when none
        has said."""
        for endpoint in endpoints:
            stats = await self._recent_stats(endpoint)
            if stats is not None:
                return stats.tool_call_parser
        return None

    async def ready_max_model_len(self, endpoints: list[str]) -> int | None:
        """The context length the deployment's ready replicas serve (the smallest, should
        they differ); None when none of them is ready."""
        all_stats = await asyncio.gather(*(self._recent_stats(ep) for ep in endpoints))
        lengths = [
            stats.max_model_len
            for stats in all_stats
            if stats is not None and stats.ready and stats.max_model_len
        ]
        return min(lengths, default=None)

    async def choose(self, endpoints: list[str]) -> str:
        """The least-loaded ready replica, one whose step has not stalled first (see
        ``STALLED_STEP_SECONDS``: its engine exits past ``--step-timeout``, and until then new
        requests would wait behind the stalled step); raises ``NoReadyReplica``."""
        if len(endpoints) == 1:
            # One replica: nothing to choose, and the request itself reports a dead engine.
            return endpoints[0]
        all_stats = await asyncio.gather(*(self._recent_stats(ep) for ep in endpoints))
        ready = [
            (
                stats.step_seconds >= STALLED_STEP_SECONDS,
                stats.num_requests_running + stats.num_requests_waiting + self._in_flight[ep],
                ep,
            )
            for ep, stats in zip(endpoints, all_stats, strict=True)
            if stats is not None and stats.ready
        ]
        if not ready:
            raise NoReadyReplica(f"none of {len(endpoints)} replicas is ready")
        return min(ready)[2]

    async def route(self, endpoints: list[str], max_context: int | None) -> tuple[str, int]:
        """The replica to send a request to and the context length it serves (the
        deployment's ``max_context`` where it fixes a lower one); raises ``NoReadyReplica``.
        Asking the replica for its context length also connects a new client before the first
        request goes out."""
        endpoint = await self.choose(endpoints)
        engine_max_len = await self.max_model_len(endpoint)
        if engine_max_len is None:
            raise NoReadyReplica(f"the replica at {endpoint} is not answering")
        return endpoint, min(max_context or engine_max_len, engine_max_len)

    @contextlib.contextmanager
    def track(self, endpoint: str) -> Iterator[None]:
        """Count a request against ``endpoint`` while it runs."""
        self._in_flight[endpoint] += 1
        try:
            yield
        finally:
            self._in_flight[endpoint] -= 1

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


_pools: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EnginePool]" = (
    weakref.WeakKeyDictionary()
)


def get_pool() -> EnginePool:
    """This event loop's pool."""
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = _pools[loop] = EnginePool()
    return pool
