"""Structured outputs: grammars compiled with xgrammar, a matcher per request, and the token
bitmask the sampler applies to a step's guided rows.

Why xgrammar (and not llguidance): on the demo model's 8,192-token vocabulary, filling the
masks of 64 requests in the middle of a JSON object takes 0.09 ms with xgrammar's matchers and
0.3 ms with llguidance's (0.07 ms on its thread pool), and a schema compiles in 30-45 ms
against llguidance's 160 ms for its 64 matchers; vLLM uses xgrammar by default too
(``bench/guided_decoding.py`` measures the step cost). Both libraries' own CPU ``apply``
functions cost more than the fill (xgrammar's took 2.7 ms for 64 rows), so the mask is applied
here with one vectorized ``masked_fill`` that works the same on a GPU.

A compiled grammar depends only on the constraint and the tokenizer, and is kept (least recently
used first out, ``CACHE_LIMIT_BYTES`` in all), so a schema a tenant sends a thousand times
compiles once. Once per tenant: the cache is keyed by the request's prefix cache salt too, as
the KV cache's blocks are, since a compile takes tens of milliseconds and a tenant timing its
first token could otherwise tell that another had sent the same schema. Importing this module
loads neither torch nor xgrammar (the core imports it before it builds its runner).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import msgspec

from inference_engine.protocol import StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerBase

# compiled grammars kept, in all
CACHE_LIMIT_BYTES = 256 << 20
# xgrammar prefixes its messages with a time and a C++ source position
_SOURCE_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: .*? is false: )?")
_ANY_OBJECT_SCHEMA = '{"type": "object"}'
_CLOSING_CHARS = set('"]}')
# a regex's groups nested deeper than this are refused: xgrammar's converter recurses per
# group, and 30,000 of them (60 KB) overflowed its stack and killed the engine
MAX_PATTERN_NESTING = 64
# an object's optional properties: each adds to every other's grammar (10 s for 1,500 on
# the intake thread, which every new request waits behind); 256 compile in a few ms
MAX_OPTIONAL_PROPERTIES = 256
# keywords xgrammar does not enforce: refused rather than ignored (a schema that says "not"
# would be served as if it did not)
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")


class InvalidGrammar(ValueError):
    """A constraint the grammar library cannot compile; the message says why."""


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` against one model's tokenizer. Thread-safe: the
    server compiles on its compile queue's threads, ahead of the busy loop that matches."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        # where a grammar's output may end: the model's EOS, or the tokenizer's if it has none
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = eos_token_ids or frozenset(() if eos is None else (eos,))
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._closing_tokens: tuple[list[int], list[float]] | None = None
        self._lock = threading.Lock()  # the cache's: held for a look or a change, never longer
        # builds of the library and of the closing tokens (each a whole vocabulary's read)
        self._build_lock = threading.Lock()
        # (salt, constraint) -> its compiled grammar, least recently used first
        self._compiled: OrderedDict[tuple[str, bytes], xgrammar.CompiledGrammar] = OrderedDict()
        self._compiled_bytes = 0

    def _library(self) -> xgrammar.GrammarCompiler:
        """The xgrammar compiler, built on first use: reading a large vocabulary takes a
        moment that engines which never see a constraint should not pay at start."""
        with self._build_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self.vocab_size,
                    stop_token_ids=sorted(self.stop_token_ids) or None,
                )
                # its own cache is shared by every caller: this class keeps one per salt
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(
        self, spec: StructuredOutputsParams, salt: str | None = None
    ) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` for the callers sharing ``salt`` (a tenant's prefix
        cache salt), from the cache where they compiled it before; ``InvalidGrammar`` naming
        the problem if it cannot be compiled."""
        compiled = self.cached(spec, salt)
        if compiled is not None:
            return compiled
        key = (salt or "", msgspec.msgpack.encode(spec))
        compiled = self._compile(spec)
        with self._lock:
            if key not in self._compiled:
                self._compiled[key] = compiled
                self._compiled_bytes += compiled.memory_size_bytes
            while self._compiled_bytes > CACHE_LIMIT_BYTES and len(self._compiled) > 1:
                _, oldest = self._compiled.popitem(last=False)
                self._compiled_bytes -= oldest.memory_size_bytes
        return compiled

    def cached(
        self, spec: StructuredOutputsParams, salt: str | None = None
    ) -> xgrammar.CompiledGrammar | None:
        """The compiled grammar of ``spec`` for ``salt``'s callers where the cache holds it."""
        key = (salt or "", msgspec.msgpack.encode(spec))
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
            return compiled

    def cache_bytes(self) -> int:
        """What the compiled grammars kept take."""
        with self._lock:
            return self._compiled_bytes

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._library()
        kind = spec.kind()
        try:
            if kind == "json":
                check_json_schema(spec.json)
                grammar = json_schema_grammar(spec.json)
                # compact JSON: a model cannot loop on whitespace between the tokens
                compiled = (
                    compiler.compile_json_schema(spec.json, any_whitespace=False)
                    if grammar is None
                    else compiler.compile_grammar(grammar)
                )
            elif kind == "json_object":
                compiled = compiler.compile_json_schema(_ANY_OBJECT_SCHEMA, any_whitespace=False)
            elif kind == "regex":
                check_pattern(spec.regex, "structured_outputs.regex")
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                compiled = compiler.compile_grammar(spec.grammar)
        except RuntimeError as exc:
            reason = _SOURCE_PREFIX.sub("", str(exc).strip())
            raise InvalidGrammar(f"structured_outputs.{kind} cannot be compiled: {reason}") from exc
        if not self._allows_a_start(compiled):
            # a schema that refers only to itself ({"$ref": "#"}): refused here, not after
            # the request's prefill as a step that found no token to draw
            raise InvalidGrammar(f"structured_outputs.{kind} allows no output at all")
        return compiled

    def _allows_a_start(self, compiled: xgrammar.CompiledGrammar) -> bool:
        """Whether any token may begin the grammar's output."""
        import xgrammar

        bitmask = fill_bitmask([xgrammar.GrammarMatcher(compiled)], self.vocab_size)
        return bool(bitmask.ne(0).any())

    def closing_tokens(self) -> tuple[list[int], list[float]]:
        """The tokens that close JSON values and how strongly a request near its token limit
        is steered to each (``Request.wants_closing``): EOS most (the value is complete),
        then a token that starts with a quote (inside a string it ends the string; outside
        one the grammar rules it out, except to open a key or an empty string), then the
        other tokens made only of quotes, brackets and braces, and last a comma (where the
        grammar allows no bracket: a number or a string before a required key)."""
        with self._build_lock:
            if self._closing_tokens is None:
                texts = self._tokenizer.batch_decode([[i] for i in range(len(self._tokenizer))])
                weights = {}
                for token_id, text in enumerate(texts):
                    text = text.strip()
                    if text == ",":  # on to a required key, where a bracket cannot end it yet
                        weights[token_id] = 0.5
                    elif text and set(text) <= _CLOSING_CHARS:
                        weights[token_id] = 2.0 if text.startswith('"') else 1.0
                weights.update(dict.fromkeys(self.stop_token_ids, 3.0))
                ids = sorted(weights)
                self._closing_tokens = ids, [weights[token_id] for token_id in ids]
            return self._closing_tokens

    def matcher(
        self, spec: StructuredOutputsParams, salt: str | None = None
    ) -> xgrammar.GrammarMatcher:
        """A new matcher at the start of ``spec``'s language."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(spec, salt))


def json_schema_grammar(schema_text: str) -> str | None:
    r"""xgrammar's grammar of the JSON schema ``schema_text`` (EBNF) with the rule of every
    length-bounded string's characters replaced by JSON's (``JSON_STRING_CHARACTER``); None
    where the schema bounds no string's length, for the compiler to take as it is.

    xgrammar 0.2.8's own rule (``[^"\\\r\n]``) admits raw control characters (invalid JSON:
    ``{"code": "y\x12"}`` was sampled); the pattern ``^[\s\S]{min,max}$`` that replaced it
    admitted raw quotes and newlines from 129 characters on, and compiled in time that grows
    with the bound (22 s at 5,000). This keeps xgrammar's repetition of one character rule,
    which compiles at once whatever the bound, and counts an escape as the one character it
    is."""
    if "Length" not in schema_text:  # no minLength or maxLength anywhere
        return None
    import xgrammar

    grammar = str(xgrammar.Grammar.from_json_schema(schema_text, any_whitespace=False))
    fixed, count = _BOUNDED_STRING_CHARACTERS.subn(
        lambda rule: f"{rule[1]} ::= {JSON_STRING_CHARACTER}", grammar
    )
    return fixed if count else None


# a length-bounded string's character, as xgrammar 0.2.8 writes its rule
_BOUNDED_STRING_CHARACTERS = re.compile(r'^(\S+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
# a character of a JSON string: any but a quote, a backslash or a control character, or an
# escape
JSON_STRING_CHARACTER = (
    r'(([^"\\\0-\x1f]) | ("\\" (["\\/bfnrt] | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] '
    r"[A-Fa-f0-9]))))"
)
# the most a length or count bound may be (xgrammar's repetitions count in 32 bits)
MAX_LENGTH_BOUND = 2**31 - 1
_LENGTH_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"))


def _check_length_bounds(node: dict, where: str) -> None:
    """``InvalidGrammar`` for a length or count bound that is no count up to
    ``MAX_LENGTH_BOUND``, or a lower bound above its upper one (xgrammar wrapped 2**40 to a
    small number, and named 2**31 only as a repetition range of negative numbers)."""
    for low_name, high_name in _LENGTH_BOUNDS:
        for name in (low_name, high_name):
            value = node.get(name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LENGTH_BOUND
            ):
                raise InvalidGrammar(
                    f"{where}: {name!r} must be a whole number from 0 to {MAX_LENGTH_BOUND}"
                )
        low, high = node.get(low_name), node.get(high_name)
        if low is not None and high is not None and low > high:
            raise InvalidGrammar(f"{where}: {low_name!r} is {low}, above {high_name!r} ({high})")


def check_pattern(pattern: str, where: str) -> None:
    """``InvalidGrammar`` where a regex nests its groups deeper than ``MAX_PATTERN_NESTING``."""
    depth = deepest = 0
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
    if deepest > MAX_PATTERN_NESTING:
        raise InvalidGrammar(
            f"{where} nests groups {deepest} deep; at most {MAX_PATTERN_NESTING} are supported"
        )


# keywords whose value is one subschema, a list of them, or a name -> subschema map
_SUBSCHEMA = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema_text: str) -> None:
    """``InvalidGrammar`` for what a JSON schema asks that would not be served as asked: a
    keyword xgrammar ignores (``UNENFORCED_KEYWORDS``, an ``allOf`` of several schemas), a
    pattern nested too deep for its converter, an object with more than
    ``MAX_OPTIONAL_PROPERTIES`` optional properties. Text that is not JSON is left to the
    compiler to report."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return
    where = "structured_outputs.json"
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node:
                raise InvalidGrammar(f"{where}: {keyword!r} is not supported (it is not enforced)")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise InvalidGrammar(
                f"{where}: 'allOf' of several schemas is not supported (it is not enforced); "
                "merge them into one"
            )
        if isinstance(node.get("pattern"), str):
            check_pattern(node["pattern"], f"{where} pattern")
        _check_length_bounds(node, where)
        properties = node.get("properties")
        if isinstance(properties, dict):
            required = node.get("required")
            required = set(required) if isinstance(required, list) else set()
            optional = len(properties.keys() - required)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise InvalidGrammar(
                    f"{where}: an object has {optional} optional properties; at most "
                    f"{MAX_OPTIONAL_PROPERTIES} are supported (list more in 'required')"
                )
        for keyword in _SUBSCHEMA:
            stack.append(node.get(keyword))
        for keyword in _SUBSCHEMA_LISTS:
            if isinstance(node.get(keyword), list):
                stack.extend(node[keyword])
        for keyword in _SUBSCHEMA_MAPS:
            subschemas = node.get(keyword)
            if isinstance(subschemas, dict):
                if keyword == "patternProperties":
                    for key in subschemas:
                        check_pattern(str(key), f"{where} patternProperties key")
                stack.extend(subschemas.values())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(matchers: list[xgrammar.GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The allowed next tokens of each matcher as packed bits, ``[len(matchers), ⌈V/32⌉]``
    int32 on the host (bit ``j % 32`` of word ``j // 32`` is token ``j``)."""
    import torch

    bitmask = torch.empty(len(matchers), bitmask_width(vocab_size), dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bits_on_host(bitmask: torch.Tensor, vocab_size: int):
    """``[R, ⌈V/32⌉]`` int32 words as ``[R, V]`` uint8 bits, by numpy (a CPU tensor in)."""
    import numpy as np

    # little-endian words: bit k of word w is bit k % 8 of byte 4w + k // 8
    as_bytes = bitmask.numpy().view(np.uint8)
    return np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :vocab_size]


def unpack_bits_on_device(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The same as ``unpack_bits_on_host`` with torch's shifts, where the words are."""
    import torch

    shifts = _BIT_SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _BIT_SHIFTS[bitmask.device] = torch.arange(
            32, dtype=torch.int32, device=bitmask.device
        )
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit works too
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[i], j]`` to -inf wherever bit ``j`` of ``bitmask[i]`` is 0, in place.
    ``rows`` and ``bitmask`` are on the logits' device. On the CPU numpy unpacks the bits
    (0.07 ms for 64 rows of 8,192 tokens, against 0.8 ms for torch's shifts); on a GPU the
    shifts run on the device."""
    import torch

    vocab_size = logits.shape[-1]
    if logits.device.type == "cpu":
        disallowed = torch.from_numpy(unpack_bits_on_host(bitmask, vocab_size) == 0)
    else:
        disallowed = unpack_bits_on_device(bitmask, vocab_size) == 0
    if rows.numel() == logits.shape[0]:  # every row guided (rows are distinct, ascending)
        logits.masked_fill_(disallowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
