"""Tokens per second of ``ppctl generate``'s decoding against ``transformers``' ``generate``, on the same weights.

For each model (a GPT-2 and a Llama of the sizes given, random weights, float32) it saves a
``transformers`` model into a temporary folder and loads it both ways: ``from_pretrained``, and ppctl's
whole-model chunk through ``model.init_from``, as ``ppctl generate HF_DIR`` does (``ppctl.generate.source``;
a character tokenizer is saved beside, which the benchmark does not use: it feeds ids). Both decode greedily
the same prompt for the same number of new tokens with a KV cache (ppctl: ``generate_ids``; transformers:
``generate(do_sample=False)``, no end-of-text id), in turns, on the same torch threads, after one warm-up
each; the time runs from the prompt's step to the last token. The table shows each side's median tokens per
second, the ratio ppctl / transformers, and whether the two produced the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import divides, names_in, positive_int  # noqa: E402
from ppctl.generate.decode import generate_ids  # noqa: E402
from ppctl.generate.sampling import Sampling  # noqa: E402
from ppctl.generate.source import load_model  # noqa: E402

GREEDY = Sampling(temperature=0.0)
MODELS = ("gpt2", "llama")
TOKENIZER_IDS = 50  # the character tokenizer saved beside (unused: the benchmark feeds ids)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one is argparse's error, exit 2, before any model."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=6)
    parser.add_argument("--hidden", type=positive_int, default=512)
    parser.add_argument("--heads", type=positive_int, default=8)
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="Llama's key/value heads")
    parser.add_argument("--vocab", type=positive_int, default=8192)
    parser.add_argument("--prompt", type=positive_int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=positive_int, default=128, help="new tokens per generation")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    parser.add_argument("--models", type=names_in(MODELS), default=",".join(MODELS),
                        help=f"comma-separated: {', '.join(MODELS)}")
    args = parser.parse_args(argv)
    divides(parser, ("--hidden", args.hidden), ("--heads", args.heads))
    if "llama" in args.models:
        divides(parser, ("--heads", args.heads), ("--kv-heads", args.kv_heads))
        if args.hidden // args.heads % 2:
            parser.error(f"--hidden {args.hidden} / --heads {args.heads} is {args.hidden // args.heads}: llama's "
                         f"rotary embedding needs an even head width")
    return args


def randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Draw every weight (norm scales around 1; GPT-2's ``c_attn`` bias zero, as when the README's numbers were
    measured: ppctl reads it as a bias, both sides add it)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw = torch.randn(param.shape, generator=generator)
            if "c_attn.bias" in name:
                param.zero_()
            else:
                param.copy_(1 + 0.1 * draw if "ln" in name or "norm" in name else 0.05 * draw)
    return model


def gpt2_pair(args, folder: Path):
    """(ppctl chunk, transformers model) of one random GPT-2 (exact GELU), ppctl's read through init_from."""
    from tests.harness.char_tokenizer import save_char_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.prompt + args.new, n_embd=args.hidden,
                        n_layer=args.layers, n_head=args.heads, activation_function="gelu", tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=None)
    randomised(GPT2LMHeadModel(config)).save_pretrained(folder)
    save_char_tokenizer(folder, min(TOKENIZER_IDS, args.vocab))
    return load_model(folder).chunk, GPT2LMHeadModel.from_pretrained(folder).eval()


def llama_pair(args, folder: Path):
    """(ppctl chunk, transformers model) of one random Llama (grouped-query attention), ppctl's through init_from."""
    from tests.harness.char_tokenizer import save_char_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.prompt + args.new,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    randomised(LlamaForCausalLM(config)).save_pretrained(folder)
    save_char_tokenizer(folder, min(TOKENIZER_IDS, args.vocab))
    return load_model(folder).chunk, LlamaForCausalLM.from_pretrained(folder).eval()


def timed(function) -> tuple[float, list[int]]:
    """(seconds, the ids) of one generation."""
    started = time.perf_counter()
    ids = function()
    return time.perf_counter() - started, ids


def compare(name: str, ours, hf, args) -> dict:
    """Median tokens per second of each side over ``args.repeats`` generations in turns, after a warm-up each."""
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    sides = {
        "ppctl": lambda: list(generate_ids(ours, prompt[0].tolist(), args.new, GREEDY)),
        "transformers": lambda: hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                            max_new_tokens=args.new, min_new_tokens=args.new,
                                            pad_token_id=0)[0, args.prompt:].tolist(),
    }
    times = {side: [] for side in sides}
    ids = {side: run() for side, run in sides.items()}  # warm-up
    for _ in range(args.repeats):
        for side, run in sides.items():
            seconds, ids[side] = timed(run)
            times[side].append(seconds)
    rates = {side: args.new / statistics.median(seconds) for side, seconds in times.items()}
    return {"model": name, **rates, "ratio": rates["ppctl"] / rates["transformers"],
            "same": ids["ppctl"] == ids["transformers"]}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    pairs = {"gpt2": gpt2_pair, "llama": llama_pair}
    print(f"torch {torch.__version__}, {args.threads} threads; {args.layers} layers, hidden {args.hidden}, "
          f"{args.heads} heads (llama: {args.kv_heads} kv heads), vocab {args.vocab}; prompt {args.prompt} tokens, "
          f"{args.new} new, greedy, float32, median of {args.repeats}")
    print("| model | ppctl tokens/s | transformers tokens/s | ratio ppctl / transformers | same tokens |")
    print("|---|---|---|---|---|")
    for name in args.models:
        with tempfile.TemporaryDirectory() as folder:
            row = compare(name, *pairs[name](args, Path(folder)), args)
        print(f"| {row['model']} | {row['ppctl']:,.1f} | {row['transformers']:,.1f} | {row['ratio']:.3f} | "
              f"{'yes' if row['same'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
