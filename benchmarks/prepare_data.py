"""Speed and peak memory of ``ppctl prepare-data`` against the tokenizer's own throughput, on a corpus of a few GB.

The corpus (``--gib`` GiB, kept in ``--work`` and reused) is ``--files`` ``.jsonl`` files of rows
``{"text": ...}``: documents of 200 to 20,000 characters (log-uniform) made of passages of consecutive lines
of a plain-text file (``--source-text``, by default the repository's sample, tinyshakespeare) taken at
random places by a seeded RNG, so that a BPE meets natural text, not random bytes; it is written one document
at a time. The tokenizer is a byte-level BPE with ``<|endoftext|>`` trained by ``tokenizers`` on a few MB of
the same kind of text, 32,000 ids asked (the sample's merges run out at 21,446: every word is then a token),
saved as ``tokenizer.json`` in ``--work``; or ``--tokenizer FILE``.

For each corpus size and process count, in turns (the order swapped every repeat), each side runs as a fresh
Python process, timed from its start to its exit:

  * the baseline, the practical limit: ``tokenizers``' ``encode_batch(texts, add_special_tokens=True)`` on
    batches of 1,000 documents in ``--num-proc`` processes (``spawn``), each reading its share of every file
    (a byte range cut at newlines) and counting tokens, writing nothing;
  * ``ppctl prepare-data data=text`` on the corpus folder with that tokenizer, ``data.num_proc`` the same,
    in a new ``data.cache_dir`` each time (removed after): the tokens it wrote are read from the entry it
    made (an entry folder of Megatron shards with ``index.json``, or a flat ``<name>.bin`` with its
    ``<name>.json`` index).

A thread samples every ``--interval-ms`` the sum of the resident sets (``VmRSS``, from ``/proc``) of the side's
process and all its descendants, and the sum of their proportional sets (``Pss``: a page shared by forked processes
counted once in all, where VmRSS counts it in each): the table shows both peaks. Before the turns, one read-only
pass (the baseline's reading and JSON parsing without the tokenizer) says how much of the time reading alone takes,
and warms the page cache for both sides. Tokens per second are the text's tokens (the baseline's count) over each
side's median wall time: ppctl writes the same tokens and one end-of-document id per document more.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.args import non_negative_int, positive_float, positive_int  # noqa: E402

MiB, GiB = 2**20, 2**30
DOCUMENT_CHARS = (200, 20_000)
PASSAGE_LINES = (2, 40)
BATCH_DOCUMENTS = 1000  # datasets' map batch, which ppctl's engine used: the same for the baseline
VOCAB_SIZE = 32_000
END_OF_TEXT = "<|endoftext|>"
TOKENIZER_TRAINING_CHARS = 4_000_000
DEFAULT_SOURCE_TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
DEFAULT_WORK = Path(tempfile.gettempdir()) / "ppctl-prepare-data-bench"
# the child that runs the baseline: this module imported from the repository root, nothing else loaded
BASELINE_CODE = ("import json, sys; sys.path.insert(0, sys.argv[2]); "
                 "from benchmarks.prepare_data import encode_corpus; print(json.dumps(encode_corpus(json.loads("
                 "sys.argv[1]))))")
PPCTL_CODE = "import sys; from ppctl.cli.app import main; sys.exit(main())"  # the `ppctl` console script's entry


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``, else the command line's); a bad one is argparse's error, exit 2, before any file is
    written or process started."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=positive_float, nargs="+", default=[2.0],
                        help="corpus sizes in GiB, each measured in turn (e.g. 0.25 1: memory against size; "
                             "0.05 to try the script)")
    parser.add_argument("--num-proc", type=positive_int, nargs="+", default=[os.cpu_count() or 1],
                        help="process counts, each measured (default: this machine's cores)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="turns of each side per row")
    parser.add_argument("--files", type=positive_int, default=8, help=".jsonl files the corpus is cut into")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the corpus's RNG seed")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK,
                        help="folder of the corpora and the tokenizer, kept and reused (default: %(default)s)")
    parser.add_argument("--tokenizer", type=Path, help="a tokenizers JSON file to use instead of the trained BPE")
    parser.add_argument("--source-text", type=Path, default=DEFAULT_SOURCE_TEXT,
                        help="plain text the corpus and the BPE are made from (default: %(default)s)")
    parser.add_argument("--interval-ms", type=positive_float, default=50.0, help="how often the RSS is sampled")
    args = parser.parse_args(argv)
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no such file")
    if args.work.exists() and not args.work.is_dir():
        parser.error(f"--work {args.work}: not a folder")
    return args


# ---- the corpus -------------------------------------------------------------------------------------------------

def line_starts(text: str) -> list[int]:
    """The offset of each line's first character in ``text``, and ``len(text)`` last."""
    starts = [0]
    position = text.find("\n")
    while position != -1:
        starts.append(position + 1)
        position = text.find("\n", position + 1)
    if starts[-1] != len(text):
        starts.append(len(text))
    return starts


def make_document(rng: random.Random, text: str, starts: list[int]) -> str:
    """One document: passages of consecutive lines from random places, cut at a log-uniform length."""
    low, high = DOCUMENT_CHARS
    length = int(math.exp(rng.uniform(math.log(low), math.log(high))))
    passages, held = [], 0
    while held < length:
        first = rng.randrange(len(starts) - 1)
        last = min(first + rng.randint(*PASSAGE_LINES), len(starts) - 1)
        passage = text[starts[first]:starts[last]]
        passages.append(passage)
        held += len(passage)
    return "".join(passages)[:length]


def corpus_paths(args, gib: float) -> tuple[Path, Path]:
    """The corpus folder of size ``gib`` (only its ``.jsonl`` files: ppctl reads the whole folder) and its manifest,
    written beside it once every file is complete."""
    name = f"corpus-{gib:g}gib-{args.files}files-seed{args.seed}"
    return args.work / name, args.work / f"{name}.json"


def ensure_corpus(args, gib: float) -> dict:
    """The manifest of the corpus of ``gib`` GiB, writing the corpus first unless a complete one is there."""
    folder, manifest = corpus_paths(args, gib)
    if manifest.is_file():
        return json.loads(manifest.read_text())
    text = read_source_text(args.source_text)
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    rng, starts = random.Random(args.seed), line_starts(text)
    per_file = int(gib * GiB / args.files)
    documents = 0
    for number in range(args.files):
        documents += write_jsonl(folder / f"part-{number:05d}.jsonl", per_file, rng, text, starts)
    record = {"gib": gib, "files": args.files, "seed": args.seed, "documents": documents,
              "bytes": sum(path.stat().st_size for path in folder.glob("*.jsonl")),
              "source_text": str(args.source_text)}
    manifest.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {folder}: {record['bytes'] / GiB:.2f} GiB, {documents:,} documents in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return record


def write_jsonl(path: Path, size: int, rng: random.Random, text: str, starts: list[int]) -> int:
    """Write documents as ``{"text": ...}`` lines to ``path`` until it holds ``size`` bytes; return how many. Written
    under a temporary name, one line at a time (memory stays one document)."""
    staged, written, documents = path.with_name(path.name + ".tmp"), 0, 0
    with open(staged, "w", encoding="utf-8") as handle:
        while written < size:
            line = json.dumps({"text": make_document(rng, text, starts)}) + "\n"
            handle.write(line)
            written += len(line)  # json.dumps escapes everything outside ASCII: characters are bytes
            documents += 1
    staged.replace(path)
    return documents


def read_source_text(path: Path) -> str:
    """The plain text the corpus is made from; exits with one line when it is missing."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as error:
        sys.exit(f"--source-text {path}: {error.strerror or error}")


def ensure_tokenizer(args) -> Path:
    """``--tokenizer``, else the byte-level BPE in ``--work`` (trained there unless it is)."""
    if args.tokenizer is not None:
        return args.tokenizer.resolve()
    path = args.work / "tokenizer.json"
    if not path.is_file():
        started = time.perf_counter()
        args.work.mkdir(parents=True, exist_ok=True)
        train_tokenizer(read_source_text(args.source_text), path, args.seed)
        print(f"trained {path} in {time.perf_counter() - started:.0f} s", flush=True)
    return path.resolve()


def train_tokenizer(text: str, path: Path, seed: int) -> None:
    """Train a byte-level BPE of ``VOCAB_SIZE`` ids with ``<|endoftext|>`` on a few MB of documents made as the
    corpus's are (another seed), and save it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng, starts = random.Random(seed + 1_000_003), line_starts(text)
    documents, held = [], 0
    while held < TOKENIZER_TRAINING_CHARS:
        documents.append(make_document(rng, text, starts))
        held += len(documents[-1])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer=trainer)
    staged = path.with_name(path.name + ".tmp")
    tokenizer.save(str(staged))
    staged.replace(path)


# ---- the baseline (runs in its own child process) ---------------------------------------------------------------

def encode_corpus(job: dict) -> dict:
    """The baseline child's work: every file read (and encoded when ``job["encode"]``) in ``job["num_proc"]``
    processes, each its share; returns the tokens and documents counted."""
    count = job["num_proc"]
    if count == 1:
        shares = [encode_share(job, 0)]
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(count) as pool:  # each worker starts clean
            shares = pool.starmap(encode_share, [(job, index) for index in range(count)])
    return {key: sum(share[key] for share in shares) for key in ("tokens", "documents")}


def encode_share(job: dict, index: int) -> dict:
    """Share ``index`` of ``job["num_proc"]``: its byte range of every file, parsed and encoded in batches."""
    tokenizer = None
    if job["encode"]:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(job["tokenizer"])
    tokens = documents = 0
    batch: list[str] = []
    for path in job["files"]:
        for line in share_lines(Path(path), index, job["num_proc"]):
            batch.append(json.loads(line)["text"])
            if len(batch) == BATCH_DOCUMENTS:
                tokens += count_tokens(tokenizer, batch)
                documents, batch = documents + len(batch), []
    tokens += count_tokens(tokenizer, batch)
    return {"tokens": tokens, "documents": documents + len(batch)}


def count_tokens(tokenizer, texts: list[str]) -> int:
    """The tokens of ``texts`` with the tokenizer's special tokens (0 without a tokenizer: the read-only pass).
    ``len`` of an encoding does not copy its ids into Python."""
    if tokenizer is None or not texts:
        return 0
    return sum(len(encoding) for encoding in tokenizer.encode_batch(texts, add_special_tokens=True))


def share_lines(path: Path, index: int, count: int):
    """The lines of ``path`` that start in its ``index``-th of ``count`` equal byte ranges."""
    size = path.stat().st_size
    start, end = size * index // count, size * (index + 1) // count
    with open(path, "rb") as handle:
        position = start
        if start:
            handle.seek(start - 1)
            position += len(handle.readline()) - 1  # the line holding byte start - 1 belongs to the share before
        while position < end:
            line = handle.readline()
            if not line:
                return
            position += len(line)
            yield line


# ---- running and measuring a side -------------------------------------------------------------------------------

def tree_rss(root: int) -> tuple[int, int]:
    """Bytes resident in ``root`` and all its descendants now, as the sum of their ``VmRSS`` (``statm``'s second
    field in pages) and as the sum of their ``Pss`` (shared pages counted once in all)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    parent = int(handle.read().rsplit(b")", 1)[1].split()[1])  # the name may hold spaces
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(parent, []).append(int(name))
    pages, pss_kib, pending = 0, 0, [root]
    while pending:
        pid = pending.pop()
        pending.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/statm", "rb") as handle:
                pages += int(handle.read().split()[1])
            pss_kib += proportional_kib(pid)
        except (OSError, IndexError, ValueError):
            continue
    return pages * os.sysconf("SC_PAGE_SIZE"), pss_kib * 1024


def proportional_kib(pid: int) -> int:
    """``Pss`` of ``pid`` in KiB (``smaps_rollup``): its resident pages, each shared page divided among the processes
    sharing it. Forked tokenising processes share the parent's pages, which VmRSS counts once per process."""
    with open(f"/proc/{pid}/smaps_rollup", "rb") as handle:
        for line in handle:
            if line.startswith(b"Pss:"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """A thread sampling ``tree_rss(pid)`` every ``interval`` seconds until ``stop``; ``peak`` is the largest."""

    def __init__(self, pid: int, interval: float):
        self.pid, self.interval, self.peak, self.peak_pss = pid, interval, 0, 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        """Sample until stopped."""
        while True:
            rss, pss = tree_rss(self.pid)
            self.peak, self.peak_pss = max(self.peak, rss), max(self.peak_pss, pss)
            if self._stopped.wait(self.interval):
                return

    def stop(self) -> tuple[int, int]:
        """Stop sampling; the peaks in bytes (summed RSS, summed PSS)."""
        self._stopped.set()
        self._thread.join()
        return self.peak, self.peak_pss


def run_measured(command: list[str], interval: float, log: Path) -> tuple[float, tuple[int, int]]:
    """Run ``command`` (output to ``log``): its wall time and the peak RSS of its process tree. A failure exits
    with the command and the end of its output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded: a local corpus
    env.setdefault("HF_HUB_OFFLINE", "1")
    with open(log, "wb") as output:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        sampler = PeakRss(process.pid, interval)
        code = process.wait()
        wall = time.perf_counter() - started
        peak = sampler.stop()
    if code:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        sys.exit(f"{' '.join(command[:1] + command[3:])} exited with {code}:\n" + "\n".join(tail))
    return wall, peak


def run_baseline(files: list[Path], tokenizer: Path, num_proc: int, encode: bool, interval: float,
                 log: Path) -> dict:
    """One baseline run (``encode`` False: the read-only pass): wall time, peak RSS, tokens and documents."""
    job = {"files": [str(path) for path in files], "tokenizer": str(tokenizer), "num_proc": num_proc,
           "encode": encode}
    wall, peak = run_measured([sys.executable, "-c", BASELINE_CODE, json.dumps(job), str(ROOT)], interval, log)
    counts = json.loads(log.read_text().strip().splitlines()[-1])
    return {"wall": wall, "peak": peak[0], "pss": peak[1], **counts}


def run_ppctl(folder: Path, tokenizer: Path, num_proc: int, work: Path, interval: float, log: Path) -> dict:
    """One ``ppctl prepare-data`` into a new cache folder (removed after): wall time, peak RSS, tokens written."""
    cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
    try:
        command = [sys.executable, "-c", PPCTL_CODE, "prepare-data", "data=text", f"data.path={folder}",
                   f"data.tokenizer={tokenizer}", f"data.num_proc={num_proc}", f"data.cache_dir={cache}",
                   "trainer.eval_every=0"]
        wall, peak = run_measured(command, interval, log)
        tokens, documents = prepared_counts(cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return {"wall": wall, "peak": peak[0], "pss": peak[1], "tokens": tokens, "documents": documents}


def prepared_counts(cache: Path) -> tuple[int, int]:
    """Tokens and documents of the one entry ppctl prepared in ``cache``: an entry folder with ``index.json`` (its
    Megatron shards' ``.idx`` headers and ``.bin`` sizes), or a flat ``<name>.bin`` with its ``<name>.json`` index."""
    folders = [entry for entry in cache.iterdir() if (entry / "index.json").is_file()]
    if folders:
        return indexed_counts(sorted(folders[0].glob("*.idx")))
    flat = [token_file for token_file in cache.glob("*.bin") if token_file.with_suffix(".json").is_file()]
    if flat:
        index = json.loads(flat[0].with_suffix(".json").read_text())
        return index["num_tokens"], index["num_documents"]
    sys.exit(f"{cache}: ppctl prepare-data finished, but no prepared entry is there")


def indexed_counts(idx_files: list[Path]) -> tuple[int, int]:
    """Tokens (``.bin`` bytes over the dtype's size) and sequences of Megatron ``.idx``/``.bin`` pairs."""
    import numpy as np

    from ppctl.data.indexed import DTYPE_CODES, HEADER

    tokens = documents = 0
    for idx in idx_files:
        with open(idx, "rb") as handle:
            _, _, code, sequences, _ = HEADER.unpack(handle.read(HEADER.size))
        tokens += idx.with_suffix(".bin").stat().st_size // np.dtype(DTYPE_CODES[code]).itemsize
        documents += sequences
    return tokens, documents


# ---- the table --------------------------------------------------------------------------------------------------

def measure_row(args, gib: float, num_proc: int, tokenizer: Path) -> dict:
    """One row: the read-only pass, then ``--repeats`` turns of the baseline and ppctl, order swapped each turn."""
    folder, _ = corpus_paths(args, gib)
    files = sorted(folder.glob("*.jsonl"))
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    interval = args.interval_ms / 1000
    read = run_baseline(files, tokenizer, num_proc, False, interval, logs / "read.log")
    runs: dict[str, list[dict]] = {"baseline": [], "ppctl": []}
    for repeat in range(args.repeats):
        order = ("baseline", "ppctl") if repeat % 2 == 0 else ("ppctl", "baseline")
        for side in order:
            log = logs / f"{side}.log"
            run = (run_baseline(files, tokenizer, num_proc, True, interval, log) if side == "baseline"
                   else run_ppctl(folder, tokenizer, num_proc, args.work, interval, log))
            runs[side].append(run)
            print(f"  {gib:g} GiB, {num_proc} process(es), {side}: {run['wall']:.1f} s, peak RSS "
                  f"{run['peak'] / MiB:,.0f} MiB (PSS {run['pss'] / MiB:,.0f}), {run['tokens']:,} tokens", flush=True)
    return {"gib": gib, "num_proc": num_proc, "read": read, **runs}


def row_line(row: dict) -> str:
    """The markdown line of one row (tokens/s: the text's tokens over each side's median wall time; each turn's
    ratio beside the ratio of the medians, as a machine shared with other jobs moves both sides' times)."""
    text_tokens = row["baseline"][0]["tokens"]
    baseline_wall = statistics.median(run["wall"] for run in row["baseline"])
    ppctl_wall = statistics.median(run["wall"] for run in row["ppctl"])
    peaks = [max(run[kind] for run in row[side]) / MiB for kind in ("peak", "pss") for side in ("baseline", "ppctl")]
    written = row["ppctl"][0]["tokens"]
    turns = " ".join(f"{baseline['wall'] / ppctl['wall']:.2f}"
                     for baseline, ppctl in zip(row["baseline"], row["ppctl"]))
    return (f"| {row['gib']:g} | {row['num_proc']} | {row['read']['wall']:.1f} | {baseline_wall:.1f} | "
            f"{text_tokens / baseline_wall:,.0f} | {ppctl_wall:.1f} | {text_tokens / ppctl_wall:,.0f} | "
            f"{baseline_wall / ppctl_wall:.3f} | {turns} | {peaks[0]:,.0f} / {peaks[2]:,.0f} | {peaks[1]:,.0f} / "
            f"{peaks[3]:,.0f} | {text_tokens:,} | "
            f"{written:,} | {row['read']['documents']:,} |")


def print_table(args, rows: list[dict], tokenizer: Path, corpora: dict[float, dict]) -> None:
    """The machine, the corpora, then one markdown line per (size, processes)."""
    print(f"\n{cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}, tokenizers "
          f"{tokenizers_version()}; TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset)')}; "
          f"tokenizer {tokenizer}; medians of {args.repeats}, peaks the largest")
    for gib, record in corpora.items():
        print(f"corpus {gib:g} GiB: {record['bytes']:,} bytes, {record['documents']:,} documents in "
              f"{record['files']} files ({corpus_paths(args, gib)[0]})")
    print("\n| corpus GiB | processes | read-only s | tokenizer s | tokenizer tokens/s | ppctl s | ppctl tokens/s "
          "| ratio ppctl / tokenizer | each turn's ratio | tokenizer peak RSS / PSS MiB | ppctl peak RSS / PSS MiB "
          "| tokens (text) | tokens ppctl wrote | documents |")
    print("|" + "---|" * 14)
    for row in rows:
        print(row_line(row))


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``lscpu``'s), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def tokenizers_version() -> str:
    """The installed ``tokenizers`` version."""
    import tokenizers

    return tokenizers.__version__


def main() -> None:
    """Make (or reuse) the corpora and the tokenizer, measure every (size, processes), print the table."""
    args = parse_args()
    args.work = args.work.resolve()
    corpora = {gib: ensure_corpus(args, gib) for gib in args.gib}
    tokenizer = ensure_tokenizer(args)
    rows = [measure_row(args, gib, num_proc, tokenizer) for gib in args.gib for num_proc in args.num_proc]
    print_table(args, rows, tokenizer, corpora)
    print(f"\ncommand: {' '.join([Path(sys.executable).name, *sys.argv])}")


if __name__ == "__main__":
    main()
