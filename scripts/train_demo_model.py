"""Train the bundled demo chat model (``models/demo-chat``) from scratch, offline, on the CPU.

No machine of this project can download weights, yet ``make run`` must be able to chat at
once, so the project trains and ships its own small model. The method, end to end:

1. **Corpus.** Everything comes from what every Python installation carries: the language
   reference topics in ``pydoc_data.topics`` (split into their sections) and the docstrings
   of the public functions, classes and methods of a fixed list of standard-library modules
   and of the built-in types. Each item becomes a short answer: a signature line where there
   is one, then the first paragraphs of the cleaned documentation.
2. **Chat examples.** Each item is asked about in several phrasings ("What does json.dumps
   do?", "How do I use json.dumps?", "What is the json module for?"), sometimes under a
   system prompt and sometimes as the second turn of a conversation, plus a few hand-written
   greetings. About 4% of the items (chosen by a hash of their name) are held out entirely;
   the held-out loss therefore measures answers about functions the model has never seen.
3. **Tokenizer.** A byte-level BPE (``tokenizers``) trained on the corpus, with the special
   tokens ``<|pad|> <|end|> <|system|> <|user|> <|assistant|>``. ``<|end|>`` closes every
   turn and is the eos token, so generation stops at the end of the assistant's turn.
4. **Model.** A Llama-architecture causal LM (about 7M parameters, tied embeddings), trained
   with AdamW, warmup plus cosine decay, bf16 autocast and ``torch.compile`` (about twice as
   fast on the CPU; ``--no-compile`` skips it). Examples are packed into fixed-length rows
   with ``position_ids`` restarting at every example, which makes transformers build a
   block-diagonal causal mask, so packed examples never see each other. The loss covers the
   assistant's tokens only.
5. **Export.** ``save_pretrained`` in bf16 plus the tokenizer and chat template, then the
   saved directory is reloaded with the Auto classes and asked five questions greedily; the
   answers and losses go to ``SAMPLES.md``.

Run it with ``.venv/bin/python scripts/train_demo_model.py``; the defaults reproduce the
committed model (fixed seed, 2 threads; an estimated 10 to 13 minutes on 2 idle cores,
see ``SAMPLES.md`` for how the committed weights were actually trained).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

PAD, END, SYSTEM, USER, ASSISTANT = "<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, END, SYSTEM, USER, ASSISTANT]
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

# Each turn is "<|role|>\n{content}<|end|>"; the prompt ends with "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

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

# Sample questions for SAMPLES.md; their items are always kept in the training split.
SAMPLE_QUESTIONS = [
    "What does json.dumps do?",
    "How do I use os.path.join?",
    "What is the with statement?",
    "What is a list comprehension?",
    "What does re.sub do?",
]
SHOWCASE_ITEMS = {"json.dumps", "os.path.join", "re.sub", 'The "with" statement', "List displays"}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant that answers questions about Python.",
    "You are demo-chat, a small model that explains Python's standard library.",
    "Answer the user's question concisely.",
    "You are a friendly programming assistant.",
]
FUNCTION_QUESTIONS = [
    "What does {n} do?",
    "Explain {n}.",
    "How do I use {n}?",
    "What is {n}?",
    "What is {n} used for?",
    "Tell me about {n}.",
    "Can you explain {n} in Python?",
    "What does the {n} function do?",
    "How does {n} work?",
    "{n}?",
]
METHOD_QUESTIONS = [
    "What does {n} do?",
    "Explain {n}.",
    "How do I use {n}?",
    "What is {n}?",
    "What does the {n} method do?",
    "Tell me about {n}.",
    "How does {n} work?",
]
CLASS_QUESTIONS = [
    "What is {n}?",
    "Explain {n}.",
    "What is the {n} class?",
    "How do I use {n}?",
    "Tell me about {n}.",
    "What is {n} used for?",
    "What does {n} do?",
]
MODULE_QUESTIONS = [
    "What is the {n} module for?",
    "What does the {n} module do?",
    "Tell me about the {n} module.",
    "Explain Python's {n} module.",
    "What is {n}?",
    "How do I use the {n} module?",
]
TOPIC_QUESTIONS = [
    "What is {n}?",
    "Explain {n}.",
    "How does {n} work in Python?",
    "Tell me about {n}.",
    "What are {n}?",
    "Can you explain {n}?",
    "How do I use {n}?",
]
# Everyday names for reference sections whose titles a user would not type.
TOPIC_ALIASES = {
    "List displays": ["a list comprehension", "list comprehensions", "list displays"],
    "Dictionaries": ["dictionaries", "a dict display", "dictionary displays"],
    "Lambdas": ["lambda", "a lambda", "lambda expressions"],
    "Function definitions": ["function definitions", "def", "defining a function"],
    "Class definitions": ["class definitions", "defining a class"],
    "Boolean operations": ["boolean operations", "and, or and not"],
    "Slicings": ["slicing", "slices"],
}
GREETINGS = (
    ["Hello", "Hi", "Hi there!", "Hey", "Good morning", "Hello!", "hi"],
    "Hello! I am demo-chat, a small model trained on the documentation that ships with "
    "Python. Ask me about a standard-library module, a function or a language feature, "
    "for example: What does json.dumps do?",
)
ABOUT = (
    ["Who are you?", "What are you?", "What can you do?", "What can you help me with?"],
    "I am demo-chat, a small language model trained on this project's own machines from "
    "Python's built-in documentation. I can explain standard-library modules, functions and "
    "language features such as the with statement. I am small and make mistakes, so check "
    "the official documentation for anything important.",
)
THANKS = (
    ["Thanks", "Thank you!", "thanks a lot", "Great, thanks."],
    "You're welcome! Ask me anything else about Python.",
)


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
    signature = short_signature(name, obj) if kind in ("function", "method") else None
    if kind == "class":
        signature = short_signature(name, obj)
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
    import builtins

    for cls in BUILTIN_TYPES:
        add_class(cls.__name__, cls)
    for attr in sorted(dir(builtins)):
        obj = getattr(builtins, attr)
        if attr[0] != "_" and inspect.isbuiltin(obj):
            add(api_item("function", attr, obj, max_chars))
    return list(items.values())


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
            if len(body) < 40 or title in items:
                continue
            subject = re.sub(r'"([^"]+)"', r"`\1`", title)
            if subject[:2] != subject[:2].upper():  # keep acronyms such as "OR Patterns"
                subject = subject[0].lower() + subject[1:]
            names = tuple(TOPIC_ALIASES.get(title, [subject]))
            items[title] = Item("topic", title, first_paragraphs(body, max_chars), names)
    return list(items.values())


def chat_items() -> list[Item]:
    return [
        Item("chat", f"chat-{i}", answer, (), tuple(qs))
        for i, (qs, answer) in enumerate([GREETINGS, ABOUT, THANKS])
    ]


def questions_for(item: Item) -> list[str]:
    if item.kind == "chat":
        return list(item.questions)
    templates = {
        "function": FUNCTION_QUESTIONS,
        "method": METHOD_QUESTIONS,
        "class": CLASS_QUESTIONS,
        "module": MODULE_QUESTIONS,
        "topic": TOPIC_QUESTIONS,
    }[item.kind]
    names = item.names or (item.name,)
    return [t.format(n=n) for t in templates for n in names]


def make_conversations(
    items: list[Item], rng: random.Random, phrasings: int, chat_copies: int
) -> list[list[dict[str, str]]]:
    """Single-turn Q&A per item and phrasing, some with a system prompt or a previous turn."""
    turns: list[tuple[str, str]] = []
    for item in items:
        questions = questions_for(item)
        count = len(questions) * chat_copies if item.kind == "chat" else phrasings
        for question in (
            rng.sample(questions, min(count, len(questions)))
            if count <= len(questions)
            else [rng.choice(questions) for _ in range(count)]
        ):
            if rng.random() < 0.15 and question[0].isupper():
                question = question[0].lower() + question[1:]
            turns.append((question, item.answer))
    rng.shuffle(turns)
    conversations: list[list[dict[str, str]]] = []
    i = 0
    while i < len(turns):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.15:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        num_turns = 2 if rng.random() < 0.1 else 1
        for question, answer in turns[i : i + num_turns]:
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        conversations.append(messages)
        i += num_turns
    return conversations


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_conversation(
    tokenizer: Tokenizer, messages: list[dict[str, str]]
) -> tuple[list[int], list[bool]]:
    """Token ids of the templated conversation and, per token, whether the loss covers it."""
    ids: list[int] = []
    is_target: list[bool] = []
    for message in messages:
        header = tokenizer.encode(ROLE_TOKENS[message["role"]] + "\n").ids
        body = tokenizer.encode(message["content"].strip() + END).ids
        ids += header + body
        is_target += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    return ids, is_target


def pack_rows(
    encoded: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack examples into ``seq_len`` rows: (input_ids, labels, position_ids), each [rows, T]."""
    order = list(range(len(encoded)))
    rng.shuffle(order)
    rows_ids, rows_labels, rows_pos = [], [], []
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []

    def flush() -> None:
        pad = seq_len - len(ids)
        rows_ids.append(ids + [pad_id] * pad)
        rows_labels.append(labels + [-100] * pad)
        rows_pos.append(pos + list(range(pad)))

    for index in order:
        example_ids, example_target = encoded[index]
        if len(ids) + len(example_ids) > seq_len:
            flush()
            ids, labels, pos = [], [], []
        ids += example_ids
        labels += [t if keep else -100 for t, keep in zip(example_ids, example_target, strict=True)]
        pos += list(range(len(example_ids)))
    if ids:
        flush()
    return torch.tensor(rows_ids), torch.tensor(rows_labels), torch.tensor(rows_pos)


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: tuple[torch.Tensor, ...], batch_size: int) -> float:
    """Mean loss per target token over ``rows``."""
    model.eval()
    total, count = 0.0, 0
    ids, labels, pos = rows
    for start in range(0, len(ids), batch_size):
        batch_labels = labels[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(
                input_ids=ids[start : start + batch_size],
                position_ids=pos[start : start + batch_size],
                use_cache=False,
            ).logits
        targets = batch_labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        total += loss.item()
        count += int((targets != -100).sum())
    model.train()
    return total / max(count, 1)


def build_model(
    vocab_size: int, args: argparse.Namespace, tokenizer: Tokenizer
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(END),
        pad_token_id=tokenizer.token_to_id(PAD),
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% as ``progress`` (0..1) runs out."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def save_artifacts(
    model: LlamaForCausalLM, tokenizer: Tokenizer, output: Path, max_positions: int
) -> None:
    if output.exists():
        shutil.rmtree(output)
    output.mkdir(parents=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.token_to_id(END),
        pad_token_id=tokenizer.token_to_id(PAD),
        do_sample=False,
    )
    model.save_pretrained(output, safe_serialization=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        model_max_length=max_positions,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(output)


def generate_samples(output: Path, max_new_tokens: int) -> list[tuple[str, str]]:
    """Reload the saved model the way users will and answer ``SAMPLE_QUESTIONS`` greedily."""
    tokenizer = AutoTokenizer.from_pretrained(output)
    model = AutoModelForCausalLM.from_pretrained(output)
    samples = []
    for question in SAMPLE_QUESTIONS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        samples.append((question, answer.strip()))
    return samples


def write_samples_md(output: Path, samples: list[tuple[str, str]], stats: dict) -> None:
    lines = [
        "# demo-chat: sample answers",
        "",
        "Written by `scripts/train_demo_model.py` right after training: the saved directory is",
        "reloaded with `AutoModelForCausalLM`/`AutoTokenizer`, and each question is asked on",
        "its own through the chat template with greedy decoding and at most",
        f"{stats['max_new_tokens']} new tokens. The answers are as generated, unedited.",
        "",
        f"- command: `{stats['command']}`",
        f"- parameters: {stats['params'] / 1e6:.2f}M ({stats['size_mb']:.1f} MB on disk, bf16)",
        f"- training: {stats['steps']} of {stats['max_steps']} steps, "
        f"{stats['train_tokens'] / 1e6:.1f}M tokens, {stats['train_minutes']:.1f} min on "
        f"{stats['threads']} CPU threads (compile: {stats['compile']})",
        f"- final train loss: {stats['train_loss']:.3f} (assistant tokens, sample of the "
        "training rows)",
        f"- held-out loss: {stats['heldout_loss']:.3f} (assistant tokens of "
        f"{stats['heldout_items']} items never seen in training)",
        "",
        "The items behind these five questions are kept in the training split, so the answers",
        "show what the model recalls about documentation it was trained on; the held-out loss",
        "shows how it does on functions it never saw.",
        "",
    ]
    for question, answer in samples:
        lines += [
            f"## {question}",
            "",
            *[f"> {line}" if line else ">" for line in answer.split("\n")],
            "",
        ]
    (output / "SAMPLES.md").write_text("\n".join(lines))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path("models/demo-chat"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=18.0,
        help="wall-clock budget for the whole run; on a slow machine training "
        "stops early (learning rate decayed by time) and still saves",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=704)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--max-positions", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--phrasings", type=int, default=4, help="questions per item")
    parser.add_argument("--answer-chars", type=int, default=600)
    parser.add_argument("--heldout-percent", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-rows", type=int, default=128)
    parser.add_argument("--sample-tokens", type=int, default=96)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    items = collect_api_items(args.answer_chars) + collect_topic_items(args.answer_chars)
    heldout_items = [
        item
        for item in items
        if zlib.crc32(item.name.encode()) % 100 < args.heldout_percent
        and item.name not in SHOWCASE_ITEMS
    ]
    heldout_names = {item.name for item in heldout_items}
    train_items = [item for item in items if item.name not in heldout_names] + chat_items()
    kinds = {
        k: sum(item.kind == k for item in train_items)
        for k in ("function", "method", "class", "module", "topic", "chat")
    }
    print(f"items: {len(train_items)} train {kinds}, {len(heldout_items)} held out", flush=True)

    train_conversations = make_conversations(train_items, rng, args.phrasings, chat_copies=8)
    heldout_conversations = make_conversations(heldout_items, rng, args.phrasings, 1)
    texts = [m["content"] for c in train_conversations for m in c]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    print(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens ({time.time() - started:.0f}s)", flush=True
    )

    # An example longer than a row would lose its closing <|end|>; there are only a few.
    train_encoded = [
        e
        for c in train_conversations
        if len((e := encode_conversation(tokenizer, c))[0]) <= args.seq_len
    ]
    heldout_encoded = [
        e
        for c in heldout_conversations
        if len((e := encode_conversation(tokenizer, c))[0]) <= args.seq_len
    ]
    pad_id = tokenizer.token_to_id(PAD)
    num_tokens = sum(len(ids) for ids, _ in train_encoded)
    num_targets = sum(sum(t) for _, t in train_encoded)
    print(
        f"examples: {len(train_encoded)} train ({num_tokens / 1e6:.2f}M tokens, "
        f"{num_targets / 1e6:.2f}M targets), {len(heldout_encoded)} held out",
        flush=True,
    )
    heldout_rows = pack_rows(heldout_encoded, args.seq_len, pad_id, random.Random(args.seed))
    heldout_rows = tuple(t[: args.eval_rows] for t in heldout_rows)
    train_sample_rows = tuple(
        t[: args.eval_rows]
        for t in pack_rows(train_encoded, args.seq_len, pad_id, random.Random(args.seed + 1))
    )

    model = build_model(tokenizer.get_vocab_size(), args, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    forward = model
    if not args.no_compile:
        try:
            forward = torch.compile(model)
        except Exception as error:  # noqa: BLE001 - compile is an optimisation only
            print(f"torch.compile unavailable, running eagerly: {error}", flush=True)

    epoch = 0
    rows = pack_rows(train_encoded, args.seq_len, pad_id, random.Random(args.seed + 100))
    cursor = 0
    train_started = time.time()
    # Leave a minute for the final evaluation, saving and the sample answers.
    budget_s = args.max_minutes * 60 - (train_started - started) - 60
    ema_loss = float("nan")
    step = 0
    train_tokens = 0
    bar = tqdm(total=args.steps, desc="train", mininterval=5, ascii=True)
    while step < args.steps:
        if cursor + args.batch_size > len(rows[0]):
            epoch += 1
            rows = pack_rows(
                train_encoded, args.seq_len, pad_id, random.Random(args.seed + 100 + epoch)
            )
            cursor = 0
        batch = [t[cursor : cursor + args.batch_size] for t in rows]
        cursor += args.batch_size
        # The schedule follows whichever runs out first, steps or time, so a slow (shared)
        # machine still ends on a decayed learning rate.
        elapsed = time.time() - train_started
        progress = max(step / args.steps, elapsed / budget_s)
        lr = lr_at(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(
                input_ids=batch[0], labels=batch[1], position_ids=batch[2], use_cache=False
            ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        train_tokens += batch[0].numel()
        ema_loss = loss.item() if step == 1 else 0.95 * ema_loss + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema_loss:.3f}", epoch=epoch, lr=f"{lr:.1e}", refresh=False)
        if step % args.eval_every == 0:
            heldout = evaluate(model, heldout_rows, args.batch_size)
            tqdm.write(
                f"step {step}: train {ema_loss:.3f} held-out {heldout:.3f} "
                f"epoch {epoch} ({(time.time() - train_started) / 60:.1f} min)"
            )
        if progress >= 1.0:
            tqdm.write(f"time budget reached at step {step} of {args.steps}; stopping")
            break
    bar.close()
    train_minutes = (time.time() - train_started) / 60
    train_loss = evaluate(model, train_sample_rows, args.batch_size)
    heldout = evaluate(model, heldout_rows, args.batch_size)
    print(
        f"final: train {train_loss:.3f} held-out {heldout:.3f} "
        f"after {step} steps, {train_minutes:.1f} min",
        flush=True,
    )

    save_artifacts(model, tokenizer, args.output, args.max_positions)
    samples = generate_samples(args.output, args.sample_tokens)
    size_mb = sum(f.stat().st_size for f in args.output.iterdir()) / 1e6
    stats = {
        "command": " ".join(["python", *sys.argv]),
        "params": num_params,
        "size_mb": size_mb,
        "steps": step,
        "max_steps": args.steps,
        "train_tokens": train_tokens,
        "train_minutes": train_minutes,
        "threads": args.threads,
        "compile": "no" if forward is model else "yes",
        "train_loss": train_loss,
        "heldout_loss": heldout,
        "heldout_items": len(heldout_items),
        "max_new_tokens": args.sample_tokens,
    }
    write_samples_md(args.output, samples, stats)
    (args.output / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    for question, answer in samples:
        print(f"\nQ: {question}\nA: {answer}", flush=True)
    print(f"\nsaved {args.output} ({size_mb:.1f} MB) in {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
