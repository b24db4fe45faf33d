"""Fixtures that build tiny random-weight models and a small byte-level tokenizer offline.

Weights use a large init std so greedy argmaxes are far from ties and parity is stable.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.inference_engine import triton_interpreter

triton_interpreter.enable()  # before any test module imports a Triton kernel

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|eos|>", "<|end|>", "<|user|>", "<|system|>", "<|assistant|>"]
TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny tokenizer for engine tests",
    "paged attention with prefix caching and chunked prefill",
    "one two three four five six seven eight nine ten",
] * 4
VOCAB_SIZE = 384


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|eos|>",
        pad_token="<|eos|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_config(family: str, **overrides):
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    else:
        config_class = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "qwen3": transformers.Qwen3Config,
            "mistral": transformers.MistralConfig,
        }[family]
        config = config_class(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            **common,
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def save_model(path: Path, family: str, **overrides) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(build_config(family, **overrides))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny float32 models by family, saved once per session."""
    root = tmp_path_factory.mktemp("models")
    return {
        family: save_model(root / family, family)
        for family in ("llama", "qwen2", "gpt2", "qwen3", "mistral")
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def eos_llama_dir(tmp_path_factory) -> str:
    """A llama whose config names token 0 (the tokenizer's <|eos|>) as EOS."""
    return save_model(tmp_path_factory.mktemp("eos") / "llama", "llama", eos_token_id=0)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    from transformers import AutoModelForCausalLM

    cache: dict[str, object] = {}

    def load(family: str):
        if family not in cache:
            cache[family] = AutoModelForCausalLM.from_pretrained(
                model_dirs[family], dtype="float32"
            ).eval()
        return cache[family]

    return load


@pytest.fixture(scope="session")
def llm_cache(model_dirs):
    """LLM instances keyed by (family, kwargs), so tests share loaded engines."""
    from inference_engine import LLM

    cache: dict[tuple, object] = {}

    def get(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = LLM(model_dirs[family], dtype="float32", **kwargs)
        return cache[key]

    return get


def stop_spanning_tokens(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A stop string that starts inside one token's text and ends inside a later token's, and
    the number of tokens up to the one that completes it. ``text`` is the decoded
    ``token_ids``."""
    for k in range(1, len(token_ids)):
        before = tokenizer.decode(token_ids[:k], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[: k + 1], skip_special_tokens=True)
        is_clean = text.startswith(before) and text.startswith(after)
        if not (is_clean and len(before) >= 2 and len(after) >= len(before) + 3):
            continue
        stop = before[-2:] + after[len(before) : len(before) + 2]
        if text.find(stop) == len(before) - 2 and stop.isprintable() and "\ufffd" not in stop:
            return stop, k + 1
    raise AssertionError(f"no stop string spans a token boundary in {text!r}")
