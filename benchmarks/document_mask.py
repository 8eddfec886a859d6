"""Block-causal attention (documents kept apart) on the CPU: which kernel ``data.documents=separate`` uses.

One microbatch of ``--batch`` rows of ``--seq`` tokens, each row cut into documents at ``--documents`` random
boundaries; queries, keys and values ``[batch, heads, seq, head_dim]`` in float32. Timed: one attention layer's
forward + backward, and its forward alone, the median of ``--repeats`` after ``--warmup`` rounds, the kernels
taking turns:

* ``causal``: ``F.scaled_dot_product_attention(..., is_causal=True)``, today's path (documents joined): the floor;
* ``sdpa_bool``: SDPA with the boolean block-causal mask ``[batch, 1, seq, seq]``;
* ``sdpa_additive``: SDPA with the same mask as an additive float one (0 or -inf);
* ``flex_eager``: ``flex_attention`` with a ``BlockMask`` from ``create_block_mask``, not compiled;
* ``flex_compiled`` (``--compile-flex``): ``torch.compile(flex_attention)``, its compile time left out.

FlexAttention has no backward on the CPU (torch 2.13 raises ``NotImplementedError``), so it can only be timed
forward; training there cannot use it.

The mask is built once per microbatch and serves every layer, so its build time is printed apart (``build_ms``),
beside each kernel's per-layer time. The default shape is gpt_tiny's microbatch (1 x 4 heads x 64 tokens x 16).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import non_negative_int, positive_int  # noqa: E402
from ppctl.model.attention_mask import DocumentMask  # noqa: E402


def random_segment_ids(batch: int, seq: int, documents: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, seq]`` document indices, each row cut at ``documents - 1`` random places."""
    rows = []
    for _ in range(batch):
        starts = torch.zeros(seq, dtype=torch.int64)
        cuts = torch.randperm(seq - 1, generator=generator)[:documents - 1] + 1
        starts[cuts] = 1
        rows.append(starts.cumsum(0))
    return torch.stack(rows)


def median_ms(function, repeats: int) -> float:
    """The median wall time of ``function()`` over ``repeats`` calls, in milliseconds."""
    durations = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        durations.append(1000 * (time.perf_counter() - started))
    return statistics.median(durations)


def sdpa_kernels(segment_ids: torch.Tensor, repeats: int) -> tuple[dict, dict]:
    """``({name: attend(query, key, value)}, {name: mask build ms})`` of the SDPA kernels for ``segment_ids``."""
    visible = DocumentMask.of(segment_ids).visible
    additive = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    built = {"causal": 0.0, "sdpa_bool": median_ms(lambda: DocumentMask.of(segment_ids), repeats)}
    built["sdpa_additive"] = median_ms(
        lambda: torch.zeros(visible.shape).masked_fill_(~DocumentMask.of(segment_ids).visible, float("-inf")),
        repeats)
    attends = {
        "causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "sdpa_bool": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=visible),
        "sdpa_additive": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
    }
    return attends, built


def flex_kernels(segment_ids: torch.Tensor, compile_flex: bool) -> tuple[dict, dict]:
    """The FlexAttention kernels (``flex_eager``, with ``compile_flex`` also ``flex_compiled``) and the block mask's
    build time (one build: each costs seconds)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, seq = segment_ids.shape

    def block_causal(b, h, q_index, kv_index):
        return (kv_index <= q_index) & (segment_ids[b, kv_index] == segment_ids[b, q_index])

    started = time.perf_counter()
    block_mask = create_block_mask(block_causal, batch, None, seq, seq, device="cpu")
    built = {"flex_eager": 1000 * (time.perf_counter() - started)}
    attends = {"flex_eager": lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask)}
    if compile_flex:
        compiled = torch.compile(flex_attention)
        attends["flex_compiled"] = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
        built["flex_compiled"] = built["flex_eager"]
    return attends, built


def time_kernels(attends: dict, shape: tuple[int, int, int, int], repeats: int, warmup: int,
                 backward: bool) -> dict[str, float]:
    """The median milliseconds of each kernel's forward (and ``backward``), the kernels taking turns."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator).requires_grad_(backward) for _ in range(3)]
    grad_out = torch.randn(shape, generator=generator)
    durations = {name: [] for name in attends}
    for repeat in range(warmup + repeats):
        for name, attend in attends.items():
            for tensor in inputs:
                tensor.grad = None
            started = time.perf_counter()
            with torch.set_grad_enabled(backward):
                out = attend(*inputs)
            if backward:
                out.backward(grad_out)
            if repeat >= warmup:
                durations[name].append(1000 * (time.perf_counter() - started))
    return {name: statistics.median(values) for name, values in durations.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, checked (argparse's one error line and exit 2 for a bad one)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=64)
    parser.add_argument("--head-dim", type=positive_int, default=16)
    parser.add_argument("--documents", type=positive_int, default=4, help="documents per row")
    parser.add_argument("--repeats", type=positive_int, default=200)
    parser.add_argument("--warmup", type=non_negative_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--compile-flex", action="store_true", help="also time torch.compile(flex_attention)")
    args = parser.parse_args(argv)
    if args.documents > args.seq:
        parser.error(f"--documents {args.documents} exceeds --seq {args.seq}: a document holds at least one token")
    return args


def main(argv: list[str] | None = None) -> None:
    """Time every kernel on one random microbatch and print the table."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    segment_ids = random_segment_ids(args.batch, args.seq, args.documents, torch.Generator().manual_seed(1))
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    attends, built = sdpa_kernels(segment_ids, args.repeats)
    both = time_kernels(attends, shape, args.repeats, args.warmup, backward=True)
    forward = time_kernels(attends, shape, args.repeats, args.warmup, backward=False)
    # FlexAttention last and apart: once it has run, the SDPA calls interleaved with it were slower.
    flex, flex_built = flex_kernels(segment_ids, args.compile_flex)
    built.update(flex_built)
    forward.update(time_kernels(flex, shape, args.repeats, args.warmup, backward=False))
    print(f"shape {args.batch}x{args.heads}x{args.seq}x{args.head_dim}, {args.documents} documents a row, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'kernel':<15}{'fwd+bwd ms':>12}{'fwd ms':>10}{'build ms':>10}{'fwd+bwd vs causal':>19}")
    for name, median in forward.items():
        trained = f"{both[name]:>12.3f}" if name in both else f"{'no backward':>12}"
        ratio = f"{both[name] / both['causal']:>18.2f}x" if name in both else f"{'-':>19}"
        print(f"{name:<15}{trained}{median:>10.3f}{built[name]:>10.3f}{ratio}")


if __name__ == "__main__":
    main()
