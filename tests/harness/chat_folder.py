"""A tiny tokenizer folder with a chat template, for the instruction-data tests: no download.

``save_chat_folder(folder, style, marks=True)`` writes ``tokenizer.json`` (one id per character, plus the
style's special tokens; Llama 3's post-processor puts ``<|begin_of_text|>`` before a text) and
``tokenizer_config.json`` whose ``chat_template`` is a small Llama-3-like (``llama3``) or ChatML-like
(``chatml``) template, with ``{% generation %}`` marks around the assistant's text unless ``marks`` is
False. ``CONVERSATIONS`` are rows to render: several turns, a system prompt, a multi-line answer.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

CHARACTERS = string.ascii_letters + string.digits + " .,\n!?;:-'\"()"
LLAMA3, CHATML = "llama3", "chatml"
SPECIAL_TOKENS = {
    LLAMA3: ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    CHATML: ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
}
TEMPLATES = {
    LLAMA3: (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('a system message must come first') }}{% endif %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    CHATML: (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}
SPECIAL_TOKEN_SETTINGS = {
    LLAMA3: {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    CHATML: {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
}
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "It is 4.\nAlways."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1, 2, 3."},
     {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome!"}],
]


def without_marks(template: str) -> str:
    """``template`` with its ``{% generation %}`` and ``{% endgeneration %}`` tags removed (the text unchanged)."""
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def save_chat_folder(folder: Path, style: str, marks: bool = True, template: str | None = None) -> Path:
    """Write ``folder/tokenizer.json`` and ``folder/tokenizer_config.json`` of ``style``; return the folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = SPECIAL_TOKENS[style]
    tokens = ["<unk>", *CHARACTERS, *specials]
    tokenizer = Tokenizer(models.WordLevel({token: index for index, token in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    if style == LLAMA3:  # as Llama 3's tokenizer.json: the beginning of text before every encoded text
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    tokenizer.save(str(folder / "tokenizer.json"))
    text = template if template is not None else TEMPLATES[style]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": text if marks else without_marks(text),
              "model_max_length": 4096,
              **{key: value for key, value in SPECIAL_TOKEN_SETTINGS[style].items() if value is not None}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


def write_rows(path: Path, rows: list) -> Path:
    """Write ``rows`` as a jsonl file (a row that is a string is written as it is: a broken line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path
