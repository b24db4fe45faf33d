"""The live-server tests' teardown waits for the server's last writes before the flush."""

import threading
import time

import pytest

from .conftest import wait_for_quiet_database

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_teardown_waits_for_another_clients_open_transaction():
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("SQLite has no other clients to wait for")
    import psycopg

    settings = connection.settings_dict
    other = psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        password=settings["PASSWORD"],
        dbname=settings["NAME"],
    )
    other.execute("SELECT count(*) FROM tenants_tenant")  # a transaction is now open
    committed = threading.Event()

    def commit_later() -> None:
        time.sleep(0.5)
        other.commit()
        committed.set()

    thread = threading.Thread(target=commit_later)
    thread.start()
    try:
        wait_for_quiet_database(quiet_for=0.1)
        assert committed.is_set()
    finally:
        thread.join()
        other.close()
