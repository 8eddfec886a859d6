"""``ppctl generate``'s output: the text streamed as it comes (a summary line on stderr), or one JSON object."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ppctl.generate.decode import Generated, generate
from ppctl.generate.sampling import Sampling
from ppctl.generate.source import load_model


def generate_and_print(source: Path, prompt: str, max_new_tokens: int, sampling: Sampling, seed: int,
                       as_json: bool) -> None:
    """Load the model of ``source``, continue ``prompt`` and print the text (``GenerateError`` before any output
    for what cannot be generated)."""
    model = load_model(source)
    prompt_ids = model.prompt_ids(prompt, max_new_tokens)
    result = generate(model.chunk, model.tokenizer, prompt_ids, max_new_tokens, sampling, seed, model.stop_ids,
                      None if as_json else _write_now)
    read = {"checkpoint": str(model.checkpoint), "step": model.step} if model.checkpoint is not None else {}
    if as_json:
        sys.stdout.write(json.dumps({**generated_record(prompt, result), **read}, ensure_ascii=False) + "\n")
        return
    sys.stdout.write("\n")
    source = f"; read {read['checkpoint']} (step {read['step']})" if read else ""
    typer.echo(f"{len(result.ids)} tokens in {result.seconds:.2f} s ({result.tokens_per_second:.1f} tokens/s), "
               f"stopped at {result.stopped.replace('_', ' ')}{source}", err=True)


def generated_record(prompt: str, result: Generated) -> dict:
    """What ``--json`` prints."""
    return {"prompt": prompt, "prompt_ids": result.prompt_ids, "generated_ids": result.ids, "text": result.text,
            "stopped": result.stopped, "seconds": round(result.seconds, 6),
            "tokens_per_second": round(result.tokens_per_second, 3)}


def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
