"""What Django's own user commands saved, for the audit log they do not write."""

import contextlib
from collections.abc import Iterator

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save


@contextlib.contextmanager
def users_saved() -> Iterator[list[tuple[object, bool]]]:
    """The users saved within the block, each with whether it was created."""
    saved: list[tuple[object, bool]] = []

    def remember(instance, created: bool = False, **kwargs) -> None:
        saved.append((instance, created))

    user_model = get_user_model()
    post_save.connect(remember, sender=user_model, weak=False)
    try:
        yield saved
    finally:
        post_save.disconnect(remember, sender=user_model)
