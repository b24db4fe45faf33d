"""The engine's tokenizers leave the context length to the engine: a prompt longer than the
tokenizer's ``model_max_length`` logs no transformers warning (the engine refuses it itself,
past ``max_model_len``)."""

import json
import logging
import shutil

from inference_engine.model_control import load_tokenizer


def test_a_long_prompt_logs_no_sequence_length_warning(llama_dir, tmp_path, caplog):
    model_dir = tmp_path / "model"
    shutil.copytree(llama_dir, model_dir)
    config = model_dir / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings["model_max_length"] = 16  # as a model's own files may say
    config.write_text(json.dumps(settings))
    tokenizer = load_tokenizer(str(model_dir))
    with caplog.at_level(logging.WARNING):
        ids = tokenizer("the quick brown fox " * 40, add_special_tokens=False)["input_ids"]
    assert len(ids) > 16
    assert "sequence length" not in caplog.text
