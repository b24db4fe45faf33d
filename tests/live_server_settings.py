"""Settings of the Daphne the tests start on their own database (``tests.gateway.conftest``):
the platform's, with the password hasher of the test process (``fast_password_hashing`` in
``tests/conftest.py``), so users a test makes can log in through that server and users it
makes can be read back by the test."""

from config.settings import *  # noqa: F403

TEST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
PASSWORD_HASHERS = TEST_PASSWORD_HASHERS
