"""The embedded mode's Celery broker: kombu's filesystem transport, safe for several processes.

`make run` without REDIS_URL brokers through files in ``var/celery/``: two Celery workers,
beat and each Daphne all bind queues to exchanges (an exchange's table of bindings is a file)
and publish messages (a file each). kombu's own transport creates a table by opening it for
writing before it locks it, and a message's file before it writes it, so a process reading in
between read an empty file: a JSON error that stopped a worker as it started (both bind to
``celery.pidbox`` at once) or a publish that failed. Two processes binding to a new exchange at
once also each wrote a table of their own binding only, and one was lost.

Here every file is written whole under a temporary name and renamed into place (a rename
within a folder is atomic), so a reader sees the old content or the new, never a part; and a
table's read-modify-write holds a lock file of its own, which is never truncated, so two
binds add up. Messages keep kombu's names and order, and a temporary name never matches a
queue, so the transport reads what kombu's writes. What kombu's own transport left half
written in an older ``var/`` is taken as no bindings (a table: it failed every worker that
started after it) or dropped (a message: it stopped the worker that read it). The production
mode uses Redis instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import uuid
from pathlib import Path
from time import monotonic

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes

logger = logging.getLogger(__name__)

# a file being written: a name no queue's message has (kombu matches "<stamp>.<queue>.msg")
TEMPORARY_PREFIX = ".writing-"


def _write_whole(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a part of it."""
    with tempfile.NamedTemporaryFile(
        dir=path.parent, prefix=TEMPORARY_PREFIX, suffix=".tmp", delete=False
    ) as temporary:
        try:
            temporary.write(data)
            temporary.close()
            os.replace(temporary.name, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary.name)
            raise


class Channel(filesystem.Channel):
    @contextlib.contextmanager
    def _table_lock(self, exchange: str):
        """Held across a table's read, change and write: a lock file beside the table."""
        table = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        lock_path = table.with_name(table.name + ".lock")
        try:
            lock_file = lock_path.open("ab", buffering=0)
        except OSError as exc:
            raise ChannelError(f"Cannot open {lock_path}") from exc
        try:
            filesystem.lock(lock_file, filesystem.LOCK_EX)
            yield table
        finally:
            filesystem.unlock(lock_file)
            lock_file.close()

    def get_table(self, exchange: str) -> list:
        table = self._exchange_file(exchange)
        try:
            content = table.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {table}") from exc
        try:
            return [filesystem.exchange_queue_t(*queue) for queue in filesystem.loads(content)]
        except (ValueError, TypeError):
            # what kombu's own transport left when it was killed mid-write (var/ from an older
            # version): every worker's start failed on it. Each process binds its queues again
            # as it starts, so the next bind writes a whole table in its place.
            logger.warning("%s held no readable bindings; taken as none", table)
            return []

    def _queue_bind(self, exchange, routing_key, pattern, queue) -> None:
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_lock(exchange) as table:
            queues = self.get_table(exchange)
            if binding not in queues:
                queues.insert(0, binding)
                self._write_table(table, queues)

    def _delete(self, queue, exchange, routing_key, pattern, *args, **kwargs) -> None:
        # the virtual channel's own bookkeeping, without kombu's rewrite of the table in place
        super(filesystem.Channel, self)._delete(
            queue, exchange, routing_key, pattern, *args, **kwargs
        )
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_lock(exchange) as table:
            queues = self.get_table(exchange)
            if binding in queues:
                queues.remove(binding)
                self._write_table(table, queues)

    def _write_table(self, table: Path, queues: list) -> None:
        try:
            _write_whole(table, str_to_bytes(filesystem.dumps(queues)))
        except OSError as exc:
            raise ChannelError(f"Cannot write {table}") from exc

    def _put(self, queue, payload, **kwargs) -> None:
        data = str_to_bytes(filesystem.dumps(payload))
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        path = Path(self.data_folder_out) / name
        try:
            _write_whole(path, data)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {str(path)!r} to directory") from exc

    def _get(self, queue):
        while True:
            try:
                return super()._get(queue)  # Empty when there is none
            except (ValueError, TypeError):
                # a message kombu's own transport was killed writing (var/ from an older
                # version; this one's are whole): out of the folder by now; kombu's own read
                # stopped the worker on it instead
                logger.warning("dropped a message for %s that was never written whole", queue)


class Transport(filesystem.Transport):
    Channel = Channel
