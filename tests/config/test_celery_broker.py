"""The embedded mode's broker (kombu's filesystem transport, made safe for several processes).

Every process of `make run` (two Celery workers, beat, each Daphne) binds queues to exchanges
and publishes through files in one folder. kombu's own transport creates an exchange's table
by opening it for writing before it locks it, and a message's file before it writes it: a
process that reads in between reads an empty file (a JSON error that stopped a Celery worker
at start-up), and two processes binding to a new exchange at once keep one binding of the
two. Each test here runs a second process's read or bind at that moment."""

from __future__ import annotations

import subprocess

import pytest
from kombu import Connection
from kombu.exceptions import ChannelError
from kombu.transport import filesystem

from config.celery_broker import Transport
from tests.conftest import PYTHON, ROOT, subprocess_env


def _connection(folder) -> Connection:
    (folder / "control").mkdir(exist_ok=True)
    return Connection(
        "filesystem://localhost/",
        transport=Transport,
        transport_options={
            "data_folder_in": str(folder),
            "data_folder_out": str(folder),
            "control_folder": str(folder / "control"),
        },
    )


@pytest.fixture
def channels(tmp_path):
    """Two channels on one broker folder: two processes of the platform."""
    with _connection(tmp_path) as first, _connection(tmp_path) as second:
        yield first.default_channel, second.default_channel


def test_the_embedded_mode_brokers_through_this_transport(tmp_path):
    env = subprocess_env(VAR_DIR=str(tmp_path / "var"), DATABASE_URL=None, REDIS_URL=None)
    script = (
        "import django; django.setup()\n"
        "from config.celery import app\n"
        "with app.connection_for_write() as connection:\n"
        "    transport = connection.transport\n"
        "    print(type(transport).__module__, type(transport).__name__)\n"
    )
    result = subprocess.run(
        [PYTHON, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["config.celery_broker", "Transport"]


def test_binds_at_once_to_a_new_exchange_keep_both_and_a_reader_sees_a_whole_table(
    channels, monkeypatch
):
    mine, theirs = channels
    seen: list[list] = []
    lock = filesystem.lock

    def lock_after_the_other_process(file, flags):
        # the other process binds and routes while this one is between creating and locking
        if flags == filesystem.LOCK_EX and not seen:
            seen.append(theirs.get_table("celery.pidbox"))
            theirs._queue_bind("celery.pidbox", "", "", "theirs.celery.pidbox")
        return lock(file, flags)

    monkeypatch.setattr(filesystem, "lock", lock_after_the_other_process)
    mine._queue_bind("celery.pidbox", "", "", "mine.celery.pidbox")
    monkeypatch.undo()

    assert seen == [[]]  # nothing yet, not a half-written table
    queues = {binding.queue for binding in mine.get_table("celery.pidbox")}
    assert queues == {"mine.celery.pidbox", "theirs.celery.pidbox"}
    assert {binding.queue for binding in theirs.get_table("celery.pidbox")} == queues


def test_a_table_kombu_left_half_written_is_read_as_empty_and_the_next_bind_mends_it(
    channels, tmp_path
):
    """kombu's transport killed between creating a table and writing it left an empty file,
    which stopped every worker that started after it (var/ outlives a version)."""
    mine, _ = channels
    (tmp_path / "control" / "celery.pidbox.exchange").write_bytes(b"")
    assert mine.get_table("celery.pidbox") == []
    mine._queue_bind("celery.pidbox", "", "", "mine")
    assert [binding.queue for binding in mine.get_table("celery.pidbox")] == ["mine"]


def test_an_unbind_keeps_the_other_bindings(channels):
    mine, theirs = channels
    mine._queue_bind("celery.pidbox", "", "", "mine")
    theirs._queue_bind("celery.pidbox", "", "", "theirs")
    theirs._delete("theirs", "celery.pidbox", "", "")
    assert [binding.queue for binding in mine.get_table("celery.pidbox")] == ["mine"]


def test_a_message_is_never_read_before_it_is_written_whole(channels, monkeypatch):
    mine, theirs = channels
    read_meanwhile = []
    dumps = filesystem.dumps

    def serialize_while_the_other_process_polls(payload):
        try:
            read_meanwhile.append(theirs._get("celery"))
        except filesystem.Empty:
            read_meanwhile.append(None)
        return dumps(payload)

    monkeypatch.setattr(filesystem, "dumps", serialize_while_the_other_process_polls)
    mine._put("celery", {"body": "a task"})
    monkeypatch.undo()

    assert read_meanwhile == [None]
    assert theirs._get("celery") == {"body": "a task"}
    with pytest.raises(filesystem.Empty):
        theirs._get("celery")


def test_a_message_kombu_left_half_written_is_dropped_and_the_next_one_read(channels, tmp_path):
    mine, theirs = channels
    (tmp_path / "0_left-by-a-killed-writer.celery.msg").write_bytes(b'{"body": "a ta')
    mine._put("celery", {"body": "a task"})
    assert theirs._get("celery") == {"body": "a task"}
    with pytest.raises(filesystem.Empty):
        theirs._get("celery")


def test_a_message_that_cannot_be_put_fails_as_a_channel_error_and_leaves_no_file(
    channels, tmp_path, monkeypatch
):
    mine, theirs = channels

    def full_disk(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("config.celery_broker.os.replace", full_disk)
    with pytest.raises(ChannelError):
        mine._put("celery", {"body": "a task"})
    monkeypatch.undo()
    assert [path.name for path in tmp_path.iterdir() if path.is_file()] == []
    with pytest.raises(filesystem.Empty):
        theirs._get("celery")
