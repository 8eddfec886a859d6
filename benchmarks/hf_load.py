"""A rank's peak memory while ``model.init_from`` loads a multi-GB Hugging Face checkpoint at tp=2 pp=2.

It writes a random Llama folder of a few GB in float32 (``config.json`` as ``ppctl export`` writes it,
safetensors shards of at most ``--shard-mb`` with ``model.safetensors.index.json``, made one shard at a
time so the writer never holds the model), then launches 4 gloo workers at tp=2 pp=2 (dp=1), each
building its stage chunk with ``build_chunks``, the function the trainer calls (``model.init_from``:
each rank reads its slices through safetensors' lazy ``safe_open``). Around that call each rank reads
``/proc/self/status``: the exact peak of its whole resident set (``VmHWM``, reset first through
``/proc/self/clear_refs``) and, sampled by a thread, the peak of its anonymous part (``RssAnon``).
The anonymous part is the rank's own memory: its parameters and the temporaries of the load (a
temporary that lives less than the sampling interval can be missed; the loader's reads hold at most
16 MiB each). The rest of the resident set is the checkpoint's pages that safetensors maps: page cache,
shared by every process reading the file and dropped by the kernel when memory is short. The table shows each
rank's share (the bytes of the parameters it holds), both peak increases over the worker's baseline
(torch imported, the process group joined), and their ratio to the share.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.args import check_ppctl_config, positive_float, positive_int  # noqa: E402
from tests.harness.spawn import run_workers  # noqa: E402

MiB = 2**20
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one, or a shape the tp=2 pp=2 run refuses, is
    argparse's error, exit 2, before any folder is written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=positive_int, default=12)
    parser.add_argument("--hidden", type=positive_int, default=2048)
    parser.add_argument("--heads", type=positive_int, default=16)
    parser.add_argument("--kv-heads", type=positive_int, default=4)
    parser.add_argument("--ffn", type=positive_int, default=5632, help="SwiGLU width")
    parser.add_argument("--vocab", type=positive_int, default=32000)
    parser.add_argument("--shard-mb", type=positive_int, default=512, help="largest safetensors shard written, MiB")
    parser.add_argument("--interval-ms", type=positive_float, default=2.0, help="how often a rank samples RssAnon")
    parser.add_argument("--folder", type=Path, help="an HF folder to load (kept), or where to write one "
                                                    "(default: a temporary folder, deleted at the end)")
    args = parser.parse_args(argv)
    check_ppctl_config(parser, run_overrides(args, None))
    return args


def run_overrides(args, init_from: Path | None) -> list[str]:
    """The ppctl config of the measured launch (no init_from: the shape the folder is written from)."""
    overrides = ["data=synthetic", "model=llama_tiny", "parallel=single", "parallel.tp=2", "parallel.pp=2",
                 "parallel.dp=1", "trainer.precision=fp32", "trainer.tensorboard=false", "trainer.seq_length=64",
                 "trainer.micro_batch_size=1", "trainer.global_batch_size=2", f"model.num_layers={args.layers}",
                 f"model.hidden_size={args.hidden}", f"model.num_heads={args.heads}",
                 f"model.num_kv_heads={args.kv_heads}", f"model.ffn_hidden_size={args.ffn}",
                 f"model.vocab_size={args.vocab}", "model.max_seq_length=64"]
    return overrides + ([f"model.init_from={init_from}"] if init_from else [])


def hf_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``LlamaForCausalLM`` checkpoint (untied) with its shape."""
    hidden, ffn, vocab = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["vocab_size"]
    head_dim = hidden // hf_config["num_attention_heads"]
    queries, keys = hf_config["num_attention_heads"] * head_dim, hf_config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(hf_config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes.update({f"{prefix}input_layernorm.weight": (hidden,),
                       f"{prefix}self_attn.q_proj.weight": (queries, hidden),
                       f"{prefix}self_attn.k_proj.weight": (keys, hidden),
                       f"{prefix}self_attn.v_proj.weight": (keys, hidden),
                       f"{prefix}self_attn.o_proj.weight": (hidden, queries),
                       f"{prefix}post_attention_layernorm.weight": (hidden,),
                       f"{prefix}mlp.gate_proj.weight": (ffn, hidden), f"{prefix}mlp.up_proj.weight": (ffn, hidden),
                       f"{prefix}mlp.down_proj.weight": (hidden, ffn)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def planned_shards(shapes: dict[str, tuple[int, ...]], shard_bytes: int) -> list[list[str]]:
    """The tensor names of each shard, in order, each shard at most ``shard_bytes`` (or one tensor)."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_folder(folder: Path, args) -> None:
    """A random float32 Llama HF folder of the benchmark's shape, written one shard at a time."""
    import torch
    from safetensors.torch import save_file

    from ppctl.resolve import compose_config, validate
    from ppctl.model.family import resolve_model
    from ppctl.model.llama.hf import FORMAT

    config = compose_config(run_overrides(args, None))
    validate(config)
    hf_config = {**FORMAT.hf_config(resolve_model(config).shape), "dtype": "float32"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    shapes = hf_shapes(hf_config)
    shards = planned_shards(shapes, args.shard_mb * MiB)
    generator = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for index, names in enumerate(shards):
        file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: torch.randn(shapes[name], generator=generator).mul_(0.02) for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(tensor.nbytes for tensor in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def status() -> dict[str, int]:
    """This process's ``STATUS_KEYS`` from ``/proc/self/status``, in bytes."""
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in STATUS_KEYS:
                values[key] = int(rest.split()[0]) * 1024
    return values


class AnonPeak(threading.Thread):
    """Samples ``RssAnon`` every ``interval`` seconds until stopped; ``peak`` is the largest seen."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.peak, self.done = interval, status()["RssAnon"], threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            self.peak = max(self.peak, status()["RssAnon"])

    def stop(self) -> int:
        self.done.set()
        self.join()
        self.peak = max(self.peak, status()["RssAnon"])
        return self.peak


def load_worker(rank: int, world_size: int, overrides: list[str], interval: float) -> dict:
    """Build this rank's chunks from the folder as the trainer does; its memory before, at peak and after."""
    import torch.distributed as dist

    from ppctl.resolve import compose_config
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context
    from ppctl.run.train import build_chunks

    resolved = resolve(compose_config(overrides))
    context = build_parallel_context(resolved.layout, 600)
    dist.barrier()  # every rank loads at the same time, as in a launch
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before, sampler = status(), AnonPeak(interval)
    sampler.start()
    started = time.perf_counter()
    chunks = build_chunks(resolved, context)
    seconds = time.perf_counter() - started
    anon_peak, after = sampler.stop(), status()
    share = sum(param.nbytes for chunk in chunks.values() for param in chunk.parameters())
    return {"rank": rank, "tp": context.coords["tp"], "pp": context.coords["pp"], "share": share,
            "rss_peak": after["VmHWM"] - before["VmRSS"], "anon_peak": anon_peak - before["RssAnon"],
            "anon_after": after["RssAnon"] - before["RssAnon"], "seconds": seconds}


def checkpoint_bytes(folder: Path) -> int:
    """The bytes of the folder's safetensors files."""
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


def print_table(args, rows: list[dict], folder_bytes: int, write_s: float | None) -> None:
    """Per rank: its share, the peak increases of its own memory and of its RSS, their ratios to the share."""
    from rich.console import Console
    from rich.table import Table

    written = f", written in {write_s:.0f} s" if write_s is not None else ""
    table = Table(title=f"model.init_from at tp=2 pp=2: Llama {args.layers} x {args.hidden} (ffn {args.ffn}, "
                        f"{args.heads} heads, {args.kv_heads} kv heads, vocab {args.vocab}), float32; checkpoint "
                        f"{folder_bytes / MiB:,.0f} MiB{written}")
    for column in ("rank", "tp", "pp", "share MiB", "share / checkpoint", "peak RssAnon +MiB", "/ share",
                   "peak RSS +MiB", "/ share", "RssAnon after +MiB", "load s"):
        table.add_column(column, justify="right")
    for row in sorted(rows, key=lambda row: row["rank"]):
        share = row["share"]
        table.add_row(str(row["rank"]), str(row["tp"]), str(row["pp"]), f"{share / MiB:,.0f}",
                      f"{share / folder_bytes:.3f}", f"{row['anon_peak'] / MiB:,.0f}",
                      f"{row['anon_peak'] / share:.2f}", f"{row['rss_peak'] / MiB:,.0f}",
                      f"{row['rss_peak'] / share:.2f}", f"{row['anon_after'] / MiB:,.0f}", f"{row['seconds']:.1f}")
    Console(width=160).print(table)
    print(f"RssAnon is the rank's own memory: its parameters and the load's temporaries (sampled every "
          f"{args.interval_ms:g} ms). RSS adds the checkpoint's pages that safetensors maps: page cache, shared by "
          f"every reader and dropped by the kernel when memory is short; more than the bytes a rank reads, as a "
          f"read maps whole pages and the kernel maps a page's cached neighbours with it.")


def main() -> None:
    """Write the folder (unless ``--folder`` holds one), load it on 4 ranks, print the table, delete the folder."""
    args = parse_args()
    keep = args.folder is not None
    folder = args.folder or Path(tempfile.mkdtemp(prefix="hf_load_")) / "llama"
    write_s = None
    try:
        if not (folder / "config.json").is_file():
            started = time.perf_counter()
            write_folder(folder, args)
            write_s = time.perf_counter() - started
        rows = run_workers(load_worker, 4, run_overrides(args, folder.resolve()), args.interval_ms / 1000,
                           timeout=1800)
        print_table(args, rows, checkpoint_bytes(folder), write_s)
    finally:
        if not keep:
            shutil.rmtree(folder.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
