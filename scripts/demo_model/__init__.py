"""Train the bundled demo chat model; ``scripts/train_demo_model.py`` is the one command.

- ``corpus``: documentation items from ``pydoc_data`` and standard-library docstrings.
- ``conversations``: items turned into chat examples, several question phrasings each.
- ``tokens``: the BPE tokenizer, the chat template, encoding and packing into rows.
- ``training``: the Llama model, the training loop and the evaluation loss.
- ``artifacts``: the saved model directory and ``SAMPLES.md``.
"""
