"""Build a small byte-level BPE tokenizer deterministically, offline.

Used for the bundled default model and for test checkpoints: no hub access,
same files every time for the same corpus and vocabulary size.
"""

from __future__ import annotations

import json
import os

_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Language models predict the next token from the tokens before it. The engine schedules requests in steps,
and each step runs prefill chunks and decodes together. Hello, world! How are you today? I am fine, thank you.
Once upon a time there was a small model that learned to count: one, two, three, four, five, six, seven.
def main():\n    print("hello")\n    return 0\n
"""


def build_tokenizer(path: str, vocab_size: int = 512) -> None:
    """Write tokenizer.json + tokenizer_config.json for a byte-level BPE with <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": 1 << 20,
        "chat_template": (
            "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
        ),
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
