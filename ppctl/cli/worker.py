"""Per-rank entry point started by torchrun: ``python -m ppctl.cli.worker --run-dir DIR --task TASK``.

Reads the resolved config from the run directory, joins the process group, builds the
parallel context and runs the task. Any exception is written to ``errors/rank<N>.txt``
(first line: ``Type: message``) so the launcher can name the failing rank in one line;
it is written before the process group goes, so it is on disk before the peers fail.

Every worker gets SIGTERM when torchrun dies (Linux's parent-death signal), so none is
orphaned. A training worker installs a ``StopRequest`` as soon as its process groups exist:
from then on SIGTERM or SIGINT asks the trainer to stop after its step (with a checkpoint),
and a second one ends the worker at once. Not before: joining the groups waits on the
rendezvous store, a wait that a Python signal handler cannot interrupt (a peer that died
there would hold this worker until the store's timeout), and there is nothing to save yet,
so until then SIGTERM and SIGINT keep their default and end the worker at once (SIGINT's default
is restored: Python would turn it into a KeyboardInterrupt). The launcher sends the workers the
signal the user sent, so a checkpoint saved on Ctrl-C says "interrupted by SIGINT".
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import traceback
from pathlib import Path

from ppctl.run.interrupt import ParentDeathSignal, StopRequest


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ppctl.cli.worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--task", required=True, choices=["train", "check-cluster", "bench"])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--resume-from", default=None, help="the verified checkpoint a training run resumes from")
    return parser.parse_args(argv)


def run_task(args: argparse.Namespace) -> None:
    """Initialise distributed state, build the groups and run ``args.task``."""
    import torch
    import torch.distributed as dist

    from ppctl.resolve import load_config_file
    from ppctl.resolve.resolved import resolve
    from ppctl.parallel.groups import build_parallel_context, warm_up_communicators
    from ppctl.run.faults import inject_fault, restart_resume_point

    # resolved once here, unchecked: the launcher validated this very file before it started the workers
    resolved = resolve(load_config_file(args.run_dir / "config.yaml"), check=False)
    config = resolved.config
    torch.set_num_threads(int(os.environ.get("PPCTL_THREADS", "1")))
    device = "cpu"
    if args.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
        set_tf32(config.trainer.allow_tf32)
    timeout = datetime.timedelta(seconds=config.launcher.timeout_s)
    # With NCCL, naming the device creates the communicators eagerly, each on its worker's own GPU.
    device_id = torch.device(device) if args.backend == "nccl" else None
    store, rank, world_size = attempt_store(timeout)
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device_id)
    context = build_parallel_context(resolved.layout, config.launcher.timeout_s, device.split(":")[0])
    context.device = device
    warm_up_communicators(context)  # every communicator made before step 0, in one order
    inject_fault(config.launcher.inject_fault, context.rank)
    if args.task == "check-cluster":
        from ppctl.run.cluster import run_cluster_check

        run_cluster_check(config, context, args.run_dir)
    elif args.task == "bench":
        from ppctl.bench.run import run_bench

        run_bench(context, args.run_dir)
    else:
        from ppctl.run.train import train

        stop = StopRequest().install()  # kept to the end: a late SIGTERM must not turn a finished run into a failure
        resume_from = restart_resume_point(args.resume_from, args.run_dir)
        train(resolved, context, args.run_dir, resume_from, stop=stop)
    dist.barrier()
    dist.destroy_process_group()


def attempt_store(timeout: datetime.timedelta):
    """torchrun's key-value store (``env://``) under a prefix of this attempt's own, with this worker's rank and
    the world size.

    After an elastic restart the workers meet in the store the failed attempt used, where its process
    groups' keys (each rank's address) are still kept; unprefixed, the new attempt would connect to the
    dead workers' ports.
    """
    import torch.distributed as dist
    from torch.distributed.rendezvous import rendezvous

    from ppctl.run.faults import restart_count

    store, rank, world_size = next(rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"ppctl/attempt_{restart_count()}", store), rank, world_size


def set_tf32(allowed: bool) -> None:
    """fp32 matmuls and cuDNN convolutions in TF32 or not (``trainer.allow_tf32``; torch's flags, read on CUDA)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = allowed
    torch.backends.cudnn.allow_tf32 = allowed


def _leave_process_group() -> None:
    """Leave the process group after a failure (the error file is written by then), so that peers learn at once.

    gloo: destroy it, and the peers see the sockets close. NCCL: abort it, for destroying would wait for
    pending work that a failed peer may never finish; aborting cancels the communicators without a flush.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.6
    if abort is not None:
        abort()


def _write_error(run_dir: Path, rank: str) -> None:
    error_dir = run_dir / "errors"
    error_dir.mkdir(parents=True, exist_ok=True)
    exc_type, exc, _ = sys.exc_info()
    summary = f"{exc_type.__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    tmp = error_dir / f".rank{rank}.tmp"
    tmp.write_text(summary + "\n\n" + traceback.format_exc())
    tmp.replace(error_dir / f"rank{rank}.txt")


def main(argv: list[str] | None = None) -> None:
    """Run the worker; on any error record it for the launcher and exit non-zero."""
    parent = os.getppid()  # torchrun; compared again once the parent-death signal is armed
    # The launcher forwards Ctrl-C as SIGINT: until the stop request is installed it ends this worker at once, as
    # SIGTERM does, rather than as a KeyboardInterrupt somewhere in start-up (reported as the worker's error).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if not ParentDeathSignal(signal.SIGTERM).arm(parent):
        sys.exit("ppctl.cli.worker: the launcher ended before this worker started")
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run_task(args)
    except BaseException:
        _write_error(args.run_dir, os.environ.get("RANK", "0"))
        traceback.print_exc()
        _leave_process_group()
        _end(1)
    _end(0)


def _end(code: int) -> None:
    """Exit at once with ``code`` once the console is flushed, skipping the interpreter's teardown.

    Everything the worker writes is closed by then. The teardown would free what gloo's threads may
    still hold (the work of process groups no longer used) while the interpreter goes away, which now
    and then aborts a worker that had finished its job (SIGABRT: "terminate called without an active
    exception"; seen with two runs at once on one machine); and it gives SIGTERM back its default, so
    that a late stop would kill a finished worker.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
