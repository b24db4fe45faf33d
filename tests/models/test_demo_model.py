"""The bundled demo model: its files are there, it is small, and it chats offline with plain
transformers. No quality assertion: scripts/train_demo_model.py and SAMPLES.md cover that."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "demo-chat"
REQUIRED_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "SAMPLES.md",
]
MAX_BYTES = 30 * 1024 * 1024


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)


def test_files_exist():
    missing = [name for name in REQUIRED_FILES if not (MODEL_DIR / name).is_file()]
    assert not missing


def test_directory_is_small():
    size = sum(path.stat().st_size for path in MODEL_DIR.rglob("*") if path.is_file())
    assert size < MAX_BYTES


def test_weights_are_bf16(model):
    assert model.config.model_type == "llama"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_generation_stops_at_end_of_turn(tokenizer, model):
    assert tokenizer.eos_token == "<|end|>"
    assert tokenizer.pad_token is not None
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id


def test_chat_template_ends_with_assistant_prompt(tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt == "<|system|>\nBe brief.<|end|><|user|>\nHi<|end|><|assistant|>\n"


def test_greedy_answer_is_text(tokenizer, model):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    new_ids = output[0, inputs["input_ids"].shape[1] :]
    answer = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert 0 < len(new_ids) <= 32
    assert answer.strip()
