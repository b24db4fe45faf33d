"""Example prompts for the chat's empty state: the questions the bundled demo model was shown
to answer well, read from the ``SAMPLES.md`` its training script writes beside it."""

import functools
import re
from pathlib import Path

from django.conf import settings

MAX_EXAMPLES = 4
QUESTION = re.compile(r"^## (.+\?)\s*$", re.MULTILINE)


@functools.cache
def _samples(path: Path) -> tuple[str, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return ()
    return tuple(QUESTION.findall(text)[:MAX_EXAMPLES])


def example_prompts(*, models: list[str]) -> list[str]:
    """The bundled model's sample questions when ``models`` (the tenant's) include it; none
    for any other model, whose strengths the platform cannot know."""
    if settings.SERVED_MODEL_NAME not in models:
        return []
    return list(_samples(Path(settings.MODEL_PATH) / "SAMPLES.md"))
