"""Chat templates: a conversation rendered as transformers renders it, and the characters of each assistant turn.

A template is the Jinja ``chat_template`` of a Hugging Face ``tokenizer_config.json`` (or the folder's
``chat_template.jinja``, which transformers 5 saves and prefers), compiled in
the environment transformers' ``apply_chat_template`` uses (sandboxed, ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception``, ``tojson``, ``loopcontrols``, the ``{% generation %}`` tag),
and rendered with the same variables (``messages``, ``add_generation_prompt``, the special tokens
such as ``bos_token``). The assistant turns are found from the rendering itself, prefix by prefix:
turn ``i`` is what rendering ``messages[:i + 1]`` adds to rendering ``messages[:i]`` with the
generation prompt, and the whole conversation's text must begin with both. A template for which
that does not hold is refused: nothing ever falls back to training on every token. Where the
template marks its generations, the marks must give the same characters. Pure: jinja2 only.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a folder's template (it wins over the config's)
ROLES = ("system", "developer", "user", "assistant", "tool")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatError(ValueError):
    """A conversation that cannot be trained on; ``kind`` names the fault (for counting skipped rows)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class TemplateError(ValueError):
    """A template from which the assistant turns cannot be found (the whole source is refused)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja text, the file it came from, and the special tokens it may name."""

    text: str
    origin: str
    special_tokens: tuple[tuple[str, str], ...]

    @property
    def has_generation_marks(self) -> bool:
        """Whether the template marks the assistant's text with ``{% generation %}``."""
        return GENERATION_TAG.search(self.text) is not None

    def render(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """The text of ``messages`` and the character spans the template's generation marks enclose."""
        import jinja2

        template, tracker = compiled_template(self.text)
        blocks: list[str] = []
        marks: list[tuple[int, int]] = []
        variables = dict(self.special_tokens)
        try:
            with tracker.tracking(blocks, marks):
                for block in template.generate(messages=messages, tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **variables):
                    blocks.append(block)
        except jinja2.TemplateError as error:
            raise ChatError("template fails", f"the chat template fails to render it: {first_line(error)}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as error:
            raise ChatError("template fails", f"the chat template fails to render it ({type(error).__name__}: "
                                              f"{first_line(error)})") from None
        return "".join(blocks), marks


def first_line(error: BaseException) -> str:
    """The first non-blank line of an error's message (its type's name when it has none)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def load_chat_template(path: str | Path) -> ChatTemplate:
    """The chat template of a tokenizer folder, its ``tokenizer_config.json`` or a ``.jinja`` file, as transformers
    reads it: ``chat_template.jinja`` (what transformers 5 saves) where there is one, else the config's
    ``chat_template``; the special tokens from the config (a token given as ``{"content": ...}`` is its content).
    ``TemplateError`` in one line."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    config_file = path if path.is_file() and path.suffix == ".json" else folder / TOKENIZER_CONFIG
    jinja_file = path if path.is_file() and path.suffix == ".jinja" else folder / CHAT_TEMPLATE_FILE
    if not config_file.is_file() and not jinja_file.is_file():
        raise TemplateError(f"{path}: no such file, nor a {TOKENIZER_CONFIG} or {CHAT_TEMPLATE_FILE} in it; data=chat "
                            f"renders with a chat_template (data.chat_template, or the one beside data.tokenizer)")
    config = _read_config(config_file) if config_file.is_file() else {}
    if jinja_file.is_file():
        text, origin = jinja_file.read_text(encoding="utf-8"), jinja_file
    else:
        text, origin = _template_text(config.get("chat_template"), config_file), config_file
    special = []
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special.append((key, value))
    _check_compiles(text, origin)
    return ChatTemplate(text, str(origin), tuple(special))


def _read_config(file: Path) -> dict:
    """A ``tokenizer_config.json``'s content; ``TemplateError`` when it is not a JSON object."""
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise TemplateError(f"{file}: not readable JSON ({first_line(error)})") from None
    if not isinstance(config, dict):
        raise TemplateError(f"{file}: holds a JSON {type(config).__name__}, not an object")
    return config


def _template_text(value, file: Path) -> str:
    """A ``chat_template`` entry's text: a string, or the ``default`` of a list of named templates."""
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        value = named.get("default")
    if not isinstance(value, str) or not value.strip():
        raise TemplateError(f"{file}: holds no chat_template (a Jinja string, or a list with a \"default\" one)")
    return value


def _check_compiles(text: str, file: Path) -> None:
    """``TemplateError`` naming ``file`` when the template is not valid Jinja."""
    import jinja2

    try:
        compiled_template(text)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"{file}: its chat_template is not valid Jinja (line {error.lineno}: "
                            f"{first_line(error)})") from None


@functools.lru_cache(maxsize=4)
def compiled_template(text: str):
    """``(template, tracker)``: the template compiled as transformers compiles it; the tracker records the
    character spans of ``{% generation %}`` blocks while active."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[generation_tracker_class(), jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(text), environment.generation_tracker


def _raise_exception(message):
    """The template's ``raise_exception(message)``: a Jinja ``TemplateError`` (a row the template refuses)."""
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    """The template's ``strftime_now(format)``: today's date, as transformers gives it."""
    from datetime import datetime

    return datetime.now().strftime(format_string)


@functools.lru_cache(maxsize=1)
def generation_tracker_class():
    """The Jinja extension class of the ``{% generation %}`` tag (built on first use: jinja2 is imported late)."""
    import contextlib

    import jinja2
    from jinja2.ext import Extension

    class Tracker(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and, while tracking, records its span."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.active = None  # (blocks, spans) while a render is tracked; one render at a time per template
            environment.extend(generation_tracker=self)

        def parse(self, parser):
            """Parse the tag's body up to ``endgeneration`` into a call of ``_span``."""
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller) -> str:
            """Render the body; record where it starts and ends in the text rendered so far."""
            text = caller()
            if self.active is not None:
                blocks, spans = self.active
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextlib.contextmanager
        def tracking(self, blocks: list, spans: list):
            """Record the generation spans of one render into ``spans`` (``blocks``: the text yielded so far)."""
            self.active = (blocks, spans)
            try:
                yield
            finally:
                self.active = None

    return Tracker


def check_messages(messages, messages_field: str) -> list[dict]:
    """The row's messages as a list of ``{"role", "content"}`` dicts; ``ChatError`` naming what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ChatError("no messages", f"has no \"{messages_field}\" list of messages")
    for number, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatError("no messages", f"message {number} is not an object with a \"role\"")
        if message["role"] not in ROLES:
            raise ChatError("unknown role", f"message {number} has role {message['role']!r}; roles: "
                                            f"{', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ChatError("no messages", f"message {number} ({message['role']}) has no text \"content\"")
    if not any(message["role"] == "assistant" for message in messages):
        raise ChatError("no assistant turn", "has no assistant turn (nothing to train on)")
    return messages


def assistant_spans(template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and the character span of each assistant turn, found prefix by prefix.

    Turn ``i``'s span runs from the end of ``messages[:i]`` rendered with the generation prompt to the end of
    ``messages[:i + 1]`` rendered without it; the whole text must begin with both (``TemplateError`` otherwise).
    Where the template has generation marks, they must enclose the same characters.
    """
    text, marks = template.render(messages, add_generation_prompt=False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, _ = template.render(messages[:turn], add_generation_prompt=True)
        through, _ = template.render(messages[:turn + 1], add_generation_prompt=False)
        if not through.startswith(prompt) or not text.startswith(through):
            raise TemplateError(f"the chat template of {template.origin} cannot be split into turns: the "
                                f"conversation rendered up to assistant message {turn} does not begin with its "
                                f"prompt and generation prompt, or the whole conversation does not begin with it; "
                                f"its assistant tokens cannot be found (nothing falls back to training on all)")
        if len(through) > len(prompt):
            spans.append((len(prompt), len(through)))
    if template.has_generation_marks:
        _check_marks_agree(template, spans, [mark for mark in marks if mark[1] > mark[0]])
    return text, spans


def _check_marks_agree(template: ChatTemplate, spans: list[tuple[int, int]], marks: list[tuple[int, int]]) -> None:
    """``TemplateError`` when the ``{% generation %}`` marks do not enclose the turns found prefix by prefix."""
    if spans != marks:
        raise TemplateError(f"the chat template of {template.origin} marks generations at characters {marks} but "
                            f"its assistant turns, rendered prefix by prefix, are at {spans}; fix the "
                            f"{{% generation %}} marks (or remove them)")


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span, else 0 (transformers' ``assistant_masks`` rule)."""
    mask = [0] * len(offsets)
    span_index = 0
    for token, (start, end) in enumerate(offsets):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index == len(spans):
            break
        if end > spans[span_index][0]:
            mask[token] = 1
    return mask
