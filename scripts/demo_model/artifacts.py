"""The saved model directory: bf16 weights, tokenizer and chat template, then the reloaded model
answers ``SAMPLE_QUESTIONS`` greedily into ``SAMPLES.md``."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from .tokens import ASSISTANT, CHAT_TEMPLATE, END, PAD, SYSTEM, USER

# Sample questions for SAMPLES.md; their items are always kept in the training split.
SAMPLE_QUESTIONS = [
    "What does json.dumps do?",
    "How do I use os.path.join?",
    "What is the with statement?",
    "What is a list comprehension?",
    "What does re.sub do?",
]
SHOWCASE_ITEMS = {"json.dumps", "os.path.join", "re.sub", 'The "with" statement', "List displays"}


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
