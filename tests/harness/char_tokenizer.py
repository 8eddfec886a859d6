"""A character-level Hugging Face ``tokenizers`` file for tiny test models: one id per character, no download.

``save_char_tokenizer(folder, vocab_size, end_of_text)`` writes ``tokenizer.json`` whose ids ``0 ..
vocab_size - 1`` are characters (lower case, space and punctuation, upper case, digits), then ``<unk>``, then
``<|endoftext|>`` when ``end_of_text``; text decodes by joining the characters.
"""

from __future__ import annotations

import string
from pathlib import Path

CHARACTERS = string.ascii_lowercase + " .,\n" + string.ascii_uppercase + string.digits + "!?;:-'\"()"
END_OF_TEXT, UNKNOWN = "<|endoftext|>", "<unk>"


def save_char_tokenizer(folder: Path, vocab_size: int, end_of_text: bool = False) -> Path:
    """Write ``folder/tokenizer.json`` of ``vocab_size`` ids; return its path."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = [*CHARACTERS[:vocab_size - 1 - end_of_text], UNKNOWN] + ([END_OF_TEXT] if end_of_text else [])
    tokenizer = Tokenizer(models.WordLevel({token: index for index, token in enumerate(tokens)}, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    if end_of_text:
        tokenizer.add_special_tokens([END_OF_TEXT])
    path = Path(folder) / "tokenizer.json"
    tokenizer.save(str(path))
    return path
