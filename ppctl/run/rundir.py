"""The run directory: its name, what may go into it, its writing and clearing, and the lock a live run holds on it.

Before anything starts or changes in the directory: ``run_dir_problem`` refuses a path this file system
cannot hold, a ``bench`` or ``check-cluster`` that would replace another command's run (its
``config.yaml``), and a fresh training run that would replace the checkpoints an earlier run left there;
``writable_problem`` refuses a directory (or its checkpoints folder) that cannot be written, which would
otherwise be found at the first checkpoint, with every step before it lost. ``write_run_dir`` checks
and locks before it writes (a refused run changes nothing there); ``RunDirLock`` keeps a second run out
of a live run's directory, and an earlier run's checkpoints are cleared only under it. Every refusal is
``RunDirError`` with one line; nothing here prints or exits.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import shutil
import socket
import tempfile
from pathlib import Path

from ppctl.checkpoint.files import checkpoints_dir, list_checkpoints
from ppctl.config import PpctlConfig
from ppctl.resolve import to_yaml
from ppctl.fileio import os_reason

TASK_RECORD = "task.txt"  # the command whose run a run directory holds: train, bench or check-cluster
RUN_NAMES = {"train": "a training run", "bench": "a ppctl bench run", "check-cluster": "a ppctl check-cluster run"}
# The files that show a run in a directory written before it held a task record: a training run's (also a
# submitted job's: job.json), then those of bench and check-cluster, which come with a config.yaml too.
RUN_FILES = ("config.yaml", "checkpoints", "job.json")
TASK_FILES = {"bench": "bench_request.json", "check-cluster": "cluster.json"}
# Room for the deepest file a run writes below its directory: a TensorBoard event file is about 50 characters
# and the host's name (up to 64), a checkpoint's shard file fewer.
RUN_FILES_ROOM = 128
SHOWN_CHARS = 100  # a longer path is shown by its ends in a refusal


class RunDirError(RuntimeError):
    """The run directory cannot be used, written or cleared, or another run holds it; the message is one line."""


def default_run_dir(base: str = "runs") -> Path:
    """``runs/<timestamp>``, unique to the microsecond."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return Path(base) / stamp


def run_dir_of(configured: str | None) -> Path:
    """The run directory of a launch: ``configured`` (``trainer.out_dir``), else a new ``runs/<timestamp>``."""
    return Path(configured) if configured else default_run_dir()


def run_dir_problem(run_dir: Path, task: str, resume_from: str | None = None, overwrite: bool = False) -> str | None:
    """Why ``task`` (train, bench or check-cluster) may not go into ``run_dir``, in one line, or None.

    A path too long for the file system, another command's run there (bench, check-cluster), or an earlier
    run's checkpoints a training run would replace (``reuse_problem``). Asked before anything starts or changes.
    """
    problem = path_length_problem(run_dir) or other_run_problem(run_dir, task)
    if problem is None and task == "train":
        problem = reuse_problem(run_dir, resume_from, overwrite)
    return problem


# --- a path the file system cannot hold -------------------------------------------------------------------

def path_length_problem(run_dir: Path) -> str | None:
    """Why ``run_dir`` is too long a path for its file system (one line), or None.

    Each name in it must fit NAME_MAX; the whole absolute path must leave ``RUN_FILES_ROOM`` below PATH_MAX for
    the files the run writes in it. The limits are those of the deepest folder of the path that exists.
    """
    absolute = os.path.abspath(run_dir)
    existing = nearest_directory(absolute)
    name_max = path_limit(existing, "PC_NAME_MAX", 255)
    for name in Path(absolute).parts[1:]:
        size = len(os.fsencode(name))
        if size > name_max:
            return (f"trainer.out_dir={shown(run_dir)}: the name {shown(name)} in it is {size:,} bytes long; this "
                    f"file system takes names of at most {name_max:,} bytes (NAME_MAX): choose a shorter "
                    f"trainer.out_dir")
    path_max = path_limit(existing, "PC_PATH_MAX", 4096)
    limit, size = path_max - 1 - RUN_FILES_ROOM, len(os.fsencode(absolute))
    if size > limit:
        return (f"trainer.out_dir={shown(run_dir)}: its absolute path is {size:,} bytes long; a run directory may "
                f"take at most {limit:,} (PATH_MAX={path_max:,}, less {RUN_FILES_ROOM} for the files a run writes in "
                f"it): choose a shorter trainer.out_dir")
    return None


def nearest_directory(path: str) -> str:
    """``path`` itself or its deepest ancestor that is a directory."""
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def path_limit(directory: str, name: str, default: int) -> int:
    """``os.pathconf(directory, name)``, or ``default`` where the system does not say (or sets no limit)."""
    try:
        limit = os.pathconf(directory, name)
    except (OSError, ValueError):
        return default
    return limit if limit > 0 else default


def shown(path: Path | str) -> str:
    """``path`` as a refusal shows it: whole, or by its ends when longer than ``SHOWN_CHARS``."""
    text = str(path)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS // 2]}...{text[-SHOWN_CHARS // 4:]}"


# --- a run directory that holds another command's run -----------------------------------------------------

def recorded_task(run_dir: Path) -> str | None:
    """The command whose run ``run_dir`` holds (its ``task.txt``, else what its files show), or None for none."""
    try:
        return (run_dir / TASK_RECORD).read_text().strip() or None
    except OSError:
        pass
    for task, name in TASK_FILES.items():
        if (run_dir / name).exists():
            return task
    return "train" if run_files(run_dir) else None


def run_files(run_dir: Path) -> list[str]:
    """Which of ``RUN_FILES`` ``run_dir`` holds."""
    return [name for name in RUN_FILES if os.path.lexists(run_dir / name)]


def other_run_problem(run_dir: Path, task: str) -> str | None:
    """Why ``ppctl bench`` or ``ppctl check-cluster`` may not go into ``run_dir`` (one line), or None.

    Both write their own ``config.yaml``: over another command's run they would replace the one ``ppctl status``
    and a submitted Slurm job (its ``--config-dir``) read. Their own earlier directory they may reuse; ``train``
    has its own rule (``reuse_problem``).
    """
    if task == "train":
        return None
    earlier = recorded_task(run_dir)
    if earlier is None or earlier == task:
        return None
    found = ", ".join(run_files(run_dir)) or TASK_FILES.get(earlier, TASK_RECORD)
    return (f"trainer.out_dir={run_dir} holds {RUN_NAMES.get(earlier, earlier)} ({found}); ppctl {task} would "
            f"replace its config.yaml: choose another trainer.out_dir, or leave it unset for a new runs/<timestamp>")


# --- a run directory that cannot be written ---------------------------------------------------------------

def writable_problem(run_dir: Path, with_checkpoints: bool) -> str | None:
    """Why the run cannot write into ``run_dir`` (one line), or None.

    With ``with_checkpoints``, its checkpoints folder too where one exists (where none does, the run makes it
    in ``run_dir``). Only a write tells (permissions, a read-only mount, a folder that is a file), so a file is
    created and deleted in each: a save would otherwise fail after every step before it was trained.
    """
    folders = [run_dir]
    if with_checkpoints and os.path.lexists(checkpoints_dir(run_dir)):
        folders.append(checkpoints_dir(run_dir))
    for folder in folders:
        try:
            probe_write(folder)
        except OSError as error:
            what = "its checkpoints" if folder != run_dir else "its files"
            return (f"trainer.out_dir={run_dir}: cannot write into {folder}: {error.strerror or error}; the run "
                    f"writes {what} there: make it writable, or choose another trainer.out_dir")
    return None


def probe_write(folder: Path) -> None:
    """Create and delete a file in ``folder``; OSError when either cannot be done."""
    handle, name = tempfile.mkstemp(prefix=".ppctl-write-probe-", dir=folder)
    os.close(handle)
    os.unlink(name)


# --- a run directory that holds an earlier run's checkpoints --------------------------------------------------

def committed_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints a run directory holds, oldest first: every committed ``step_<N>`` (complete or
    damaged; a partial one that was never committed is no checkpoint)."""
    return [info.step for info in list_checkpoints(run_dir) if not info.path.name.endswith(".partial")]


def resumes_its_own(run_dir: Path, resume_from: str | None) -> bool:
    """Whether ``resume_from`` (a resolved checkpoint directory) is one of ``run_dir``'s own checkpoints."""
    if not resume_from:
        return False
    return Path(resume_from).resolve().parent == checkpoints_dir(run_dir).resolve()


def reuse_problem(run_dir: Path, resume_from: str | None, overwrite: bool) -> str | None:
    """Why a training run may not go into ``run_dir`` (one line), or None.

    A run that does not resume from ``run_dir``'s own checkpoints would write its checkpoints and ``latest``
    over theirs, so it needs ``trainer.overwrite=true``; a run that does resume from them must not have it
    (that would delete what it resumes from). Asked before anything starts or changes in the directory.
    """
    steps = committed_steps(run_dir)
    if not steps:
        return None
    if resumes_its_own(run_dir, resume_from):
        if not overwrite:
            return None
        return (f"trainer.overwrite=true would delete the checkpoints of trainer.out_dir={run_dir}, and this run "
                f"resumes from one of them (trainer.resume_from={resume_from}); drop trainer.overwrite to continue "
                f"that run")
    if overwrite:
        return None
    start = f"resumes from {resume_from}" if resume_from else "starts from step 0"
    return (f"trainer.out_dir={run_dir} already holds the checkpoints of a run (newest: step {steps[-1]}); this run "
            f"{start} and would replace them: continue that run with trainer.resume_from={run_dir}, choose another "
            f"trainer.out_dir, or set trainer.overwrite=true to delete them and start over")


def clears_earlier_run(config: PpctlConfig, run_dir: Path, task: str) -> bool:
    """Whether this launch deletes an earlier run's checkpoints in ``run_dir`` (``trainer.overwrite=true``; node 0
    alone, as the nodes of a job share the run directory)."""
    return (task == "train" and config.trainer.overwrite and config.launcher.node_rank == 0
            and bool(committed_steps(run_dir)))


def clear_earlier_run(run_dir: Path) -> str | None:
    """``trainer.overwrite=true``: delete the checkpoints an earlier run left in ``run_dir``, and its TensorBoard logs
    (a new run's curves would otherwise be drawn over the old ones). Returns the line that says so, None when there
    was nothing to delete; ``RunDirError`` when something cannot be deleted. Only under the run directory's lock:
    never a live run's checkpoints."""
    steps = committed_steps(run_dir)
    if not steps:
        return None
    try:
        for folder in (checkpoints_dir(run_dir), run_dir / "tensorboard"):
            if folder.exists():
                shutil.rmtree(folder)
    except OSError as error:
        raise RunDirError(f"trainer.overwrite=true: cannot delete the earlier run's files in {run_dir}: "
                          f"{os_reason(error)}") from None
    return (f"trainer.overwrite=true: deleted the earlier run's checkpoints (newest: step {steps[-1]}) and "
            f"TensorBoard logs in {run_dir}")


# --- the run directory written, under its lock -------------------------------------------------------------

def write_run_dir(run_dir: Path, config: PpctlConfig, task: str, layout_json: str) -> RunDirLock:
    """Create the run directory, check that it can be written, lock it, write which ``task`` runs there, the resolved
    ``config.yaml`` and ``layout_json`` (``layout.json``); return the lock.

    The check and the lock come before the files: a run refused because the directory cannot be written, or
    because another one holds it, changes nothing in it. Each refusal is ``RunDirError`` (``RunDirBusy``).
    """
    lock = RunDirLock(run_dir, config.launcher.node_rank)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        problem = writable_problem(run_dir, task == "train" and config.trainer.checkpoints)
        if problem is not None:
            raise RunDirError(problem)
        lock.acquire()
        (run_dir / TASK_RECORD).write_text(f"{task}\n")
        (run_dir / "config.yaml").write_text(to_yaml(config))
        (run_dir / "layout.json").write_text(layout_json)
    except OSError as error:
        lock.release()
        raise RunDirError(f"trainer.out_dir={run_dir}: cannot create the run directory: "
                          f"{os_reason(error, run_dir)}") from None
    return lock


def write_files(run_dir: Path, files: dict[str, str]) -> None:
    """Write each ``relative path -> text`` into the run directory; ``RunDirError`` when one cannot be."""
    for relative, text in files.items():
        path = run_dir / relative
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as error:
            raise RunDirError(f"trainer.out_dir={run_dir}: cannot write {relative}: {os_reason(error, path)}") from None


# --- the run directory's lock -----------------------------------------------------------------------------

class RunDirBusy(RunDirError):
    """Another live run holds the run directory; the message is one line naming it."""


def lock_name(node_rank: int) -> str:
    """The lock file of a node's launcher: ``ppctl.lock`` (node 0), ``ppctl.node<k>.lock`` (the nodes of a
    multi-node job may share one run directory)."""
    return "ppctl.lock" if node_rank == 0 else f"ppctl.node{node_rank}.lock"


class RunDirLock:
    """An exclusive OS lock (``flock``) on ``<run dir>/ppctl.lock``, held by the launcher for the run's life.

    The file records the holder's pid and host. The kernel drops the lock when its process ends, so a
    lock file left by a dead run is simply taken over. On a file system without ``flock`` the recorded
    pid decides: a live one on this host keeps the directory, a dead one is taken over.
    """

    def __init__(self, run_dir: Path, node_rank: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / lock_name(node_rank)
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        """Take the lock or raise ``RunDirBusy``; OSError if the file cannot be written."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            holder = self._lock(fd)
            if holder is not None:
                raise RunDirBusy(self._busy_message(holder))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _lock(self, fd: int) -> tuple[int, str] | None:
        """Lock ``fd``; return the live holder (pid, host) when another run has it, else None."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            return read_lock_holder(fd) or (0, "")
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        holder = read_lock_holder(fd)  # no flock here: the recorded pid decides
        return holder if holder is not None and holder_alive(*holder) else None

    def _busy_message(self, holder: tuple[int, str]) -> str:
        pid, host = holder
        where = f" on {host}" if host and host != socket.gethostname() else ""
        who = f"ppctl pid {pid}{where}" if pid else "a ppctl process"
        return (f"trainer.out_dir={self.run_dir}: another run is using this run directory ({who}, lock "
                f"{self.path}); wait for it to end or choose another trainer.out_dir")

    def release(self) -> None:
        """Let the lock go (the file stays: removing it could let two runs lock two different files)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def read_lock_holder(fd: int) -> tuple[int, str] | None:
    """The (pid, host) a lock file records, or None when it records none."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split()
    if not fields or not fields[0].isdigit():
        return None
    return int(fields[0]), fields[1] if len(fields) > 1 else ""


def holder_alive(pid: int, host: str) -> bool:
    """Whether the process ``pid`` runs (a holder on another host counts as alive: it cannot be asked)."""
    if host and host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return pid != os.getpid()
