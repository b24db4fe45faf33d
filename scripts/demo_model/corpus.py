"""Documentation items: the language reference topics in ``pydoc_data`` and the docstrings of
the public API of a fixed list of standard-library modules and the built-in types."""

from __future__ import annotations

import builtins
import importlib
import inspect
import re
from dataclasses import dataclass

# The modules people ask about most; a short list leaves each item more training.
# fmt: off
MODULES = [
    "abc", "argparse", "base64", "bisect", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "enum", "fnmatch", "functools", "glob", "hashlib", "heapq",
    "itertools", "json", "logging", "math", "operator", "os", "os.path", "pathlib", "pickle",
    "pprint", "random", "re", "secrets", "shlex", "shutil", "statistics", "string",
    "subprocess", "sys", "tempfile", "textwrap", "time", "typing", "urllib.parse", "uuid",
]
# fmt: on
BUILTIN_TYPES = [str, list, dict, set, tuple, int, float, range]

# Everyday names for reference sections whose titles a user would not type.
TOPIC_ALIASES = {
    "List displays": ["a list comprehension", "list comprehensions", "list displays"],
    "Dictionaries": ["dictionaries", "dicts"],
    "Lambdas": ["lambda", "a lambda", "lambda expressions"],
    "Function definitions": ["function definitions", "def", "defining a function"],
    "Class definitions": ["class definitions", "defining a class"],
    "Boolean operations": ["boolean operations", "and, or and not"],
    "Slicings": ["slicing", "slices"],
    "With Statement Context Managers": ["context managers", "a context manager"],
}
# Capitalised words that stay capitalised when a title becomes a name in a question.
PROPER_WORDS = {"Python"}


@dataclass
class Item:
    """One documented thing: ``kind`` picks the question phrasings, ``answer`` is the reply."""

    kind: str  # function | method | class | module | topic | chat
    name: str
    answer: str
    names: tuple[str, ...] = ()  # what users call it in a question; defaults to (name,)
    questions: tuple[str, ...] = ()  # fixed questions (chat items)


def clean_text(text: str) -> str:
    """Unwrap paragraphs, drop code and grammar blocks, and turn reST markup into Markdown."""
    paragraphs: list[str] = []

    def drop_block() -> None:
        # A paragraph that introduced the dropped block must not end on a dangling colon.
        if paragraphs and paragraphs[-1].endswith(":"):
            last = paragraphs.pop()[:-1].rstrip()
            if len(last) >= 60:
                paragraphs.append(last + ".")

    for block in re.split(r"\n\s*\n", text.strip()):
        lines = block.split("\n")
        is_code = lines[0].startswith((" ", "\t")) or "::=" in block
        if is_code or any(line.lstrip().startswith(">>>") for line in lines):
            drop_block()
            continue
        para = " ".join(line.strip() for line in lines)
        para = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", para)
        para = re.sub(r"``([^`]+)``", r"`\1`", para)
        para = re.sub(r'"([A-Za-z_][\w.()]*)"', r"`\1`", para)
        para = re.sub(r"\s+", " ", para).strip()
        if para.endswith("::"):
            para = para[:-1]
        if len(para) < 3 or set(para) <= set("*=-~^ "):
            continue
        paragraphs.append(para)
    drop_block()
    return "\n\n".join(paragraphs)


def first_paragraphs(text: str, max_chars: int) -> str:
    """Whole paragraphs up to ``max_chars``; a long first paragraph is cut at a sentence."""
    out: list[str] = []
    for para in text.split("\n\n"):
        if out and len("\n\n".join([*out, para])) > max_chars:
            break
        if not out and len(para) > max_chars:
            sentences = re.split(r"(?<=[.!?])\s+", para)
            para = sentences[0]
            for sentence in sentences[1:]:
                if len(para) + len(sentence) + 1 > max_chars:
                    break
                para += " " + sentence
            out.append(para[: max_chars * 2])
            break
        out.append(para)
    answer = "\n\n".join(out).strip()
    return answer if answer.endswith((".", "!", "?", ":", "`", ")")) else answer + "."


def short_signature(name: str, obj: object) -> str | None:
    try:
        params = list(inspect.signature(obj).parameters.values())  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts: list[str] = []
    for param in params:
        if (
            param.kind == param.KEYWORD_ONLY
            and "*" not in parts
            and not any(p.startswith("*") for p in parts)
        ):
            parts.append("*")
        text = str(param).replace(" ", "")
        if len(", ".join([*parts, text])) > 60:
            parts.append("...")
            break
        parts.append(text)
    return f"{name}({', '.join(parts)})"


def api_item(kind: str, name: str, obj: object, max_chars: int) -> Item | None:
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 20:
        return None
    text = clean_text(doc)
    # Builtin docstrings often repeat the signature on their first line.
    text = re.sub(r"^[\w.]+\(.*?\)(?: -> [^\n]+)?\n\n", "", text)
    if len(text) < 20:
        return None
    body = first_paragraphs(text, max_chars)
    signature = short_signature(name, obj) if kind in ("function", "method", "class") else None
    answer = f"`{signature}`\n\n{body}" if signature else body
    return Item(kind, name, answer)


def collect_api_items(max_chars: int) -> list[Item]:
    """Docstrings of the public API of ``MODULES`` and the built-in types and functions."""
    items: dict[str, Item] = {}

    def add(item: Item | None) -> None:
        if item is not None and item.name not in items:
            items[item.name] = item

    def add_class(qualname: str, cls: type) -> None:
        add(api_item("class", qualname, cls, max_chars))
        for attr, member in sorted(vars(cls).items()):
            if attr.startswith("_") or not callable(member):
                continue
            add(api_item("method", f"{qualname}.{attr}", member, max_chars))

    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        module_doc = inspect.getdoc(module)
        if module_doc:
            text = clean_text(module_doc)
            if len(text) >= 20:
                add(Item("module", module_name, first_paragraphs(text, max_chars)))
        exported = set(getattr(module, "__all__", ()))
        for attr in sorted(exported or {n for n in dir(module) if n[0] != "_"}):
            obj = getattr(module, attr, None)
            home = (getattr(obj, "__module__", "") or "").lstrip("_")
            if attr not in exported and not home.startswith(module_name.split(".")[0]):
                continue  # imported from elsewhere, e.g. os.sys
            if inspect.isclass(obj):
                add_class(f"{module_name}.{attr}", obj)
            elif inspect.isroutine(obj):
                add(api_item("function", f"{module_name}.{attr}", obj, max_chars))
    for cls in BUILTIN_TYPES:
        add_class(cls.__name__, cls)
    for attr in sorted(dir(builtins)):
        obj = getattr(builtins, attr)
        if attr[0] != "_" and inspect.isbuiltin(obj):
            add(api_item("function", attr, obj, max_chars))
    return list(items.values())


def topic_names(title: str) -> tuple[str, ...]:
    """What a user calls a reference section, e.g. ``The "with" statement``: "the with
    statement" as typed in a chat box, "the `with` statement" as written in Markdown, "with
    statements" and "Python's with statement"."""
    if title in TOPIC_ALIASES:
        return tuple(TOPIC_ALIASES[title])
    if title in vars(builtins):  # None, Ellipsis, NotImplemented
        return (title,)

    def lower_words(text: str) -> str:
        # Title Case words ("With Statement Context Managers") but not acronyms ("OR
        # Patterns") nor names inside dotted paths ("numbers.Real").
        return re.sub(
            r"(?<![\w.])[A-Z][a-z]+(?![\w.])",
            lambda m: m[0] if m[0] in PROPER_WORDS else m[0].lower(),
            text,
        )

    plain = lower_words(re.sub(r'"([^"]+)"', r"\1", title))
    quoted = lower_words(re.sub(r'"([^"]+)"', r"`\1`", title))
    names = [plain, quoted]
    if keyword := re.fullmatch(r'The "([\w ]+)" statement', title):
        names += [f"{keyword[1]} statements", f"Python's {keyword[1]} statement"]
    elif keyword := re.fullmatch(r'"([\w*]+)" clause', title):
        names = [f"the {keyword[1]} clause", f"the `{keyword[1]}` clause"]
    return tuple(dict.fromkeys(names))


def collect_topic_items(max_chars: int) -> list[Item]:
    """One item per section of the language reference topics in ``pydoc_data``."""
    from pydoc_data.topics import topics

    items: dict[str, Item] = {}
    heading = re.compile(r"^(.+)\n([*=\-~^])\2{3,}$", re.MULTILINE)
    for text in topics.values():
        matches = list(heading.finditer(text))
        for i, match in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
            body = clean_text(text[match.end() : end])
            title = match.group(1).strip()
            # "Code Objects" and "Code objects" are two sections under one name.
            if len(body) < 40 or title.lower() in items:
                continue
            answer = first_paragraphs(body, max_chars)
            items[title.lower()] = Item("topic", title, answer, topic_names(title))
    return list(items.values())
