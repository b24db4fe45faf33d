"""The API key format: ``sk-`` + 8-character lookup prefix + 40-character secret.

Keys carry about 285 bits of randomness, so a single SHA-256 is the right hash (as for
GitHub or Stripe tokens): a slow password hash would only add latency to every request.
"""

import hashlib
import hmac
import secrets
import string

KEY_MARKER = "sk-"
PREFIX_LENGTH = 8
SECRET_LENGTH = 40
KEY_LENGTH = len(KEY_MARKER) + PREFIX_LENGTH + SECRET_LENGTH
_ALPHABET = string.ascii_letters + string.digits


def generate_key() -> str:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(PREFIX_LENGTH + SECRET_LENGTH))
    return KEY_MARKER + body


def hash_key(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def parse_prefix(raw_key: str) -> str | None:
    """The lookup prefix of a well-formed key, or None when the key is malformed."""
    if len(raw_key) != KEY_LENGTH or not raw_key.startswith(KEY_MARKER):
        return None
    body = raw_key[len(KEY_MARKER) :]
    if any(char not in _ALPHABET for char in body):
        return None
    return body[:PREFIX_LENGTH]


def hashes_match(raw_key: str, key_hash: str) -> bool:
    return hmac.compare_digest(hash_key(raw_key), key_hash)
