"""Train the bundled demo chat model (``models/demo-chat``) from scratch, offline, on the CPU.

No machine of this project can download weights, yet ``make run`` must be able to chat at
once, so the project trains and ships its own small model. The method, end to end (the code
lives in the ``demo_model`` package next to this script):

1. **Corpus** (``corpus``). Everything comes from what every Python installation carries: the
   language reference topics in ``pydoc_data.topics`` (split into their sections) and the
   docstrings of the public functions, classes and methods of a fixed list of
   standard-library modules and of the built-in types. Each item becomes a short answer: a
   signature line where there is one, then the first paragraphs of the cleaned documentation.
2. **Chat examples** (``conversations``). Each item is asked about in several phrasings
   ("What does json.dumps do?", "How do I use json.dumps?", "What is the json module for?"),
   sometimes under a system prompt and sometimes as the second turn of a conversation, plus a
   few hand-written greetings. A topic is asked about under each of its names, e.g. "the with
   statement", "the `with` statement" and "with statements", in 8 phrasings per name against
   4 for an API item: there are only about 170 topics against about 1,300 API items, and
   their names, unlike ``json.dumps``, are not repeated word for word in the answer, so the
   model cannot simply copy them. About 4% of the items (chosen by a hash of their name) are
   held out entirely; the held-out loss therefore measures answers about functions the model
   has never seen.
3. **Tokenizer** (``tokens``). A byte-level BPE (``tokenizers``) trained on the corpus, with
   the special tokens ``<|pad|> <|end|> <|system|> <|user|> <|assistant|>``. ``<|end|>``
   closes every turn and is the eos token, so generation stops at the end of the assistant's
   turn. Examples are packed into fixed-length rows with ``position_ids`` restarting at every
   example, so packed examples never see each other.
4. **Model** (``training``). A Llama-architecture causal LM (about 7M parameters, tied
   embeddings), trained with AdamW, warmup plus cosine decay, bf16 autocast and
   ``torch.compile`` (about twice as fast on the CPU; ``--no-compile`` skips it). The loss
   covers the assistant's tokens only.
5. **Export** (``artifacts``). ``save_pretrained`` in bf16 plus the tokenizer and chat
   template, then the saved directory is reloaded with the Auto classes and asked five
   questions greedily; the answers and losses go to ``SAMPLES.md``.

Run it with ``.venv/bin/python scripts/train_demo_model.py``; the defaults reproduce the
committed model (fixed seed, 2 threads; about 10 to 12 minutes on 2 idle cores, see
``SAMPLES.md`` for how the committed weights were actually trained).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import zlib
from pathlib import Path

# A plain `python scripts/train_demo_model.py` finds the package next to it anyway; this also
# covers importing this file from elsewhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from demo_model import artifacts, conversations, corpus, tokens, training  # noqa: E402


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
    parser.add_argument("--phrasings", type=int, default=4, help="questions per API item")
    parser.add_argument(
        "--topic-phrasings", type=int, default=8, help="questions per name of a topic"
    )
    parser.add_argument("--chat-copies", type=int, default=8, help="copies of each small talk")
    parser.add_argument("--answer-chars", type=int, default=600)
    parser.add_argument("--heldout-percent", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-rows", type=int, default=128)
    parser.add_argument("--sample-tokens", type=int, default=96)
    return parser.parse_args(argv)


def split_items(
    items: list[corpus.Item], heldout_percent: int
) -> tuple[list[corpus.Item], list[corpus.Item]]:
    """(train, held out): a fixed hash of the name holds items out, never a showcase item."""
    is_heldout = [
        zlib.crc32(item.name.encode()) % 100 < heldout_percent
        and item.name not in artifacts.SHOWCASE_ITEMS
        for item in items
    ]
    train = [item for item, out in zip(items, is_heldout, strict=True) if not out]
    heldout = [item for item, out in zip(items, is_heldout, strict=True) if out]
    return train, heldout


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)

    items = corpus.collect_api_items(args.answer_chars) + corpus.collect_topic_items(
        args.answer_chars
    )
    train_items, heldout_items = split_items(items, args.heldout_percent)
    train_items += conversations.chat_items()
    kinds = {
        k: sum(item.kind == k for item in train_items)
        for k in ("function", "method", "class", "module", "topic", "chat")
    }
    print(f"items: {len(train_items)} train {kinds}, {len(heldout_items)} held out", flush=True)

    phrasings = dict.fromkeys(("function", "method", "class", "module"), args.phrasings)
    phrasings |= {"topic": args.topic_phrasings, "chat": args.chat_copies}
    train_conversations = conversations.make_conversations(train_items, rng, phrasings)
    heldout_conversations = conversations.make_conversations(
        heldout_items, rng, phrasings | {"topic": args.phrasings}
    )
    texts = [m["content"] for c in train_conversations for m in c]
    tokenizer = tokens.train_tokenizer(texts, args.vocab_size)
    print(
        f"tokenizer: {tokenizer.get_vocab_size()} tokens ({time.time() - started:.0f}s)", flush=True
    )

    train_encoded = tokens.encode_all(tokenizer, train_conversations, args.seq_len)
    heldout_encoded = tokens.encode_all(tokenizer, heldout_conversations, args.seq_len)
    pad_id = tokenizer.token_to_id(tokens.PAD)
    num_tokens = sum(len(ids) for ids, _ in train_encoded)
    num_targets = sum(sum(t) for _, t in train_encoded)
    print(
        f"examples: {len(train_encoded)} train ({num_tokens / 1e6:.2f}M tokens, "
        f"{num_targets / 1e6:.2f}M targets), {len(heldout_encoded)} held out",
        flush=True,
    )
    heldout_rows = tokens.pack_rows(heldout_encoded, args.seq_len, pad_id, random.Random(args.seed))
    heldout_rows = tuple(t[: args.eval_rows] for t in heldout_rows)
    train_sample_rows = tuple(
        t[: args.eval_rows]
        for t in tokens.pack_rows(train_encoded, args.seq_len, pad_id, random.Random(args.seed + 1))
    )

    model = training.build_model(args, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters", flush=True)
    # Leave a minute for the final evaluation, saving and the sample answers.
    budget_s = args.max_minutes * 60 - (time.time() - started) - 60
    result = training.train(model, train_encoded, heldout_rows, pad_id, args, budget_s)
    train_loss = training.evaluate(model, train_sample_rows, args.batch_size)
    heldout = training.evaluate(model, heldout_rows, args.batch_size)
    print(
        f"final: train {train_loss:.3f} held-out {heldout:.3f} "
        f"after {result.steps} steps, {result.minutes:.1f} min",
        flush=True,
    )

    artifacts.save_artifacts(model, tokenizer, args.output, args.max_positions)
    samples = artifacts.generate_samples(args.output, args.sample_tokens)
    size_mb = sum(f.stat().st_size for f in args.output.iterdir()) / 1e6
    stats = {
        "command": " ".join(["python", *sys.argv]),
        "params": num_params,
        "size_mb": size_mb,
        "steps": result.steps,
        "max_steps": args.steps,
        "train_tokens": result.train_tokens,
        "train_minutes": result.minutes,
        "threads": args.threads,
        "compile": "yes" if result.is_compiled else "no",
        "train_loss": train_loss,
        "heldout_loss": heldout,
        "heldout_items": len(heldout_items),
        "max_new_tokens": args.sample_tokens,
    }
    artifacts.write_samples_md(args.output, samples, stats)
    (args.output / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    for question, answer in samples:
        print(f"\nQ: {question}\nA: {answer}", flush=True)
    print(f"\nsaved {args.output} ({size_mb:.1f} MB) in {(time.time() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
