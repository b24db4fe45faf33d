"""An ASGI instance that a stopping server cancels ends as when its client leaves.

Daphne, on SIGTERM, cancels each connection's application instance once, waits for them,
then exits. Django's request handling and Channels' consumers both hand their work to tasks
of their own (Django's view, the chat's reply), which the cancel does not reach: the
instance ended at once, the process exited under the work still running, and an admitted
request was never metered (its concurrency slot held until its lease ran out).
``as_disconnect_when_cancelled`` reads the cancel as the client's disconnect instead: the
instance's ``receive`` answers ``disconnect`` from then on, the work ends as it does when a
client leaves (metered, its slot given back, a reply saved), and the instance then ends, at
most ``grace`` seconds later.
"""

import asyncio
from collections.abc import Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]


async def as_disconnect_when_cancelled(
    run: Callable[[Receive], Awaitable[None]],
    receive: Receive,
    disconnect: dict,
    grace: float,
) -> None:
    """Await ``run(receive)``, with ``receive`` answering ``disconnect`` once this is
    cancelled; then re-raise the cancel."""
    loop = asyncio.get_running_loop()
    stopping = loop.create_future()  # done once the instance is cancelled

    async def receive_until_stopping() -> dict:
        if stopping.done():
            return disconnect
        message = asyncio.ensure_future(receive())
        woken = loop.create_future()

        def wake(_: asyncio.Future) -> None:
            if not woken.done():
                woken.set_result(None)

        message.add_done_callback(wake)
        stopping.add_done_callback(wake)
        try:
            await woken
            if message.done():
                return message.result()
            return disconnect
        finally:
            # also when this wait is cancelled (Django cancels its disconnect listener after
            # every response): a task left pending is logged as destroyed, twice a request
            message.cancel()
            stopping.remove_done_callback(wake)

    running = asyncio.ensure_future(run(receive_until_stopping))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        if running.done():
            raise
        stopping.set_result(None)
        try:
            await asyncio.wait((running,), timeout=grace)
        finally:  # also when cancelled again meanwhile: nothing is left running
            running.cancel()
        raise
