"""The byte-level BPE tokenizer and chat template, and examples encoded and packed into rows."""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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

Encoded = tuple[list[int], list[bool]]  # token ids, and per token whether the loss covers it
Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, labels, position_ids


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


def encode_conversation(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> Encoded:
    """Token ids of the templated conversation; the loss covers the assistant's turns only."""
    ids: list[int] = []
    is_target: list[bool] = []
    for message in messages:
        header = tokenizer.encode(ROLE_TOKENS[message["role"]] + "\n").ids
        body = tokenizer.encode(message["content"].strip() + END).ids
        ids += header + body
        is_target += [False] * len(header) + [message["role"] == "assistant"] * len(body)
    return ids, is_target


def encode_all(
    tokenizer: Tokenizer, conversations: list[list[dict[str, str]]], seq_len: int
) -> list[Encoded]:
    # An example longer than a row would lose its closing <|end|>; there are only a few.
    encoded = [encode_conversation(tokenizer, c) for c in conversations]
    return [e for e in encoded if len(e[0]) <= seq_len]


def pack_rows(encoded: list[Encoded], seq_len: int, pad_id: int, rng: random.Random) -> Rows:
    """Pack examples into ``seq_len`` rows: (input_ids, labels, position_ids), each [rows, T].

    ``position_ids`` restart at every example, which makes transformers build a
    block-diagonal causal mask, so packed examples never see each other."""
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
