"""Sync database work from async code, on shared worker threads.

``sync_to_async`` runs sync code *thread-sensitively* by default: under ASGI every request gets
a thread of its own for it, started on the request's first call and joined after its end, so
each request pays for two new threads and a new database connection. The API's hot path
(authorization, admission, metering) does self-contained work that needs no thread affinity:
each call is its own autocommit unit. ``database_worker`` runs such a function on the event
loop's shared executor instead, whose threads live on and keep their connections; the
connections are checked before and after each call exactly as at a request's start and end
(``CONN_MAX_AGE``, health checks, and handing a pooled connection back).
"""

from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from channels.db import DatabaseSyncToAsync

P = ParamSpec("P")
R = TypeVar("R")


def database_worker(function: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    return DatabaseSyncToAsync(function, thread_sensitive=False)
