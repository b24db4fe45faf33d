"""The Llama model and its training: AdamW, warmup plus cosine decay, bf16 autocast and
``torch.compile`` (about twice as fast on the CPU), loss on the assistant's tokens only."""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from .tokens import END, PAD, Encoded, Rows, pack_rows


@dataclass
class TrainResult:
    steps: int
    train_tokens: int
    minutes: float
    is_compiled: bool


def build_model(args: argparse.Namespace, tokenizer: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
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


@torch.no_grad()
def evaluate(model: torch.nn.Module, rows: Rows, batch_size: int) -> float:
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


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10% as ``progress`` (0..1) runs out."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )


def train(
    model: LlamaForCausalLM,
    train_encoded: list[Encoded],
    heldout_rows: Rows,
    pad_id: int,
    args: argparse.Namespace,
    budget_s: float,
) -> TrainResult:
    """Train for ``args.steps`` steps or ``budget_s`` seconds, whichever runs out first,
    reshuffling the packed rows every epoch."""
    optimizer = make_optimizer(model, args)
    forward = model
    if not args.no_compile:
        try:
            forward = torch.compile(model)
        except Exception as error:  # noqa: BLE001 - compile is an optimisation only
            print(f"torch.compile unavailable, running eagerly: {error}", flush=True)

    epoch = 0
    rows = pack_rows(train_encoded, args.seq_len, pad_id, random.Random(args.seed + 100))
    cursor = 0
    started = time.time()
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
        progress = max(step / args.steps, (time.time() - started) / budget_s)
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
                f"epoch {epoch} ({(time.time() - started) / 60:.1f} min)"
            )
        if progress >= 1.0:
            tqdm.write(f"time budget reached at step {step} of {args.steps}; stopping")
            break
    bar.close()
    return TrainResult(step, train_tokens, (time.time() - started) / 60, forward is not model)
