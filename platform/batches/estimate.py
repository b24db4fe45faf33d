"""How many input tokens a batch line holds before the engine counts it: the likely count the
API's admission uses (``serving.budget``, four characters a token), through the endpoint's
own parser. A line the parser refuses (it fails when it runs) counts its body's characters.

A tenant's queued batch tokens are its unfinished batches' input tokens, as OpenAI's
"enqueued tokens" limit counts them."""

from batches.jsonl import InputLine
from gateway.errors import ApiError
from gateway.validation import plan_chat, plan_completion
from serving.budget import CHARS_PER_TOKEN

PLANNERS = {"/v1/chat/completions": plan_chat, "/v1/completions": plan_completion}


def line_input_tokens(line: InputLine) -> int:
    try:
        return PLANNERS[line.url](line.body).prompt_tokens.likely
    except ApiError:
        return len(line.body) // CHARS_PER_TOKEN + 1
