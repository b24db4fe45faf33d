"""The bundled demo model through the project's own engine, as `make run` serves it: a
greedy answer to a chat question is non-empty text (no quality assertion)."""

from pathlib import Path

from inference_engine import LLM, SamplingParams

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "demo-chat"


def test_the_engine_answers_with_the_demo_model():
    llm = LLM(model=str(MODEL_DIR), num_kv_blocks=64)
    [answer] = llm.chat(
        [[{"role": "user", "content": "What does json.dumps do?"}]],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert answer.token_ids and answer.finish_reason in ("stop", "length")
    assert answer.text.strip()
