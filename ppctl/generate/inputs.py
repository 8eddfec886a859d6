"""What ``ppctl generate`` is given on its command line, checked before torch and the model are read: the prompt
must be text (UTF-8) and the seed a 64-bit one.

A shell passes a prompt's bytes as they are; Python makes the bytes that are not UTF-8 lone surrogates
(``surrogateescape``), which no tokenizer encodes: refused here, whatever the tokenizer, rather than by each
tokenizer's own exception. ``torch.Generator.manual_seed`` takes a seed in ``-2**63 .. 2**64-1``.
"""

from __future__ import annotations

SEED_MIN, SEED_MAX = -2**63, 2**64 - 1
ESCAPED_BYTES = range(0xDC80, 0xDD00)  # the lone surrogates Python's surrogateescape makes of bytes 0x80..0xff


def prompt_problem(prompt: str) -> str | None:
    """Why ``prompt`` is no text a tokenizer can encode (one line, naming the first bad byte), or None."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(prompt[error.start])
        what = f"byte 0x{code - 0xDC00:02x}" if code in ESCAPED_BYTES else f"lone surrogate U+{code:04X}"
        return f"--prompt is not UTF-8 text ({what} at character {error.start}): give the prompt as UTF-8"
    return None


def seed_problem(seed: int) -> str | None:
    """Why ``seed`` cannot seed the sampling generator (one line), or None."""
    if SEED_MIN <= seed <= SEED_MAX:
        return None
    return f"--seed={seed} must be an integer in -2**63 .. 2**64-1 (a 64-bit seed)"
