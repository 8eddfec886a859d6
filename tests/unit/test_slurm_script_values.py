"""Every value that reaches ``job.sbatch`` stays one value: the job runs nothing it did not mean to.

Each field that enters the script (partition, account, qos, an extra sbatch option, the run directory, the
directory ``ppctl submit`` ran in) is given hostile values: a newline followed by a command, ``;``, ``$(...)``,
backquotes, quotes that try to close the script's own, ``#``, spaces. A value is either refused by validation
(or ``script_problem``) in one line naming its field, or the written script is proven safe the way it would
fail: its ``#SBATCH`` lines read back, by sbatch's rules for script options, as exactly the options meant; and
bash runs the script with stand-ins for ``srun``, ``scontrol``, ``scancel`` and ``ppctl``, where nothing but
the one intended ``ppctl train`` runs and no command planted in a value leaves its mark. The same holds for
``ppctl submit prepare-data``'s job array (``prepare.sbatch``), whose folder is ``--out``.
"""

import copy
import subprocess
from pathlib import Path

import pytest

from ppctl.config import ConfigError
from ppctl.resolve import compose_config, validate
from ppctl.run.slurm import job_script, sbatch_options, script_problem
from ppctl.run.slurm_prepare import prepare_options, prepare_script

CANARY = "pwned"  # a planted command that runs leaves a file of this name
HOSTILE = [f"gpu\ntouch {CANARY}", f"gpu; touch {CANARY}", f"$(touch {CANARY})", f"`touch {CANARY}`",
           f'gpu" ; touch {CANARY} ; "', f"gpu'$(touch {CANARY})'", f"gpu # touch {CANARY}", "two words",
           f'gpu\\" --wrap="touch {CANARY}', "100%j", f"gpu\rtouch {CANARY}"]
FIELDS = ["partition", "account", "qos", "extra_args", "out_dir", "workdir"]
LAYOUTS = {"one node": [], "two nodes": ["parallel=tp2_pp2_dp2", "launcher.slurm.nodes=2"]}


@pytest.fixture(scope="module")
def composed():
    """The composed config of each layout, composed once for the module."""
    return {name: compose_config(["launcher=slurm", "data=synthetic", *overrides])
            for name, overrides in LAYOUTS.items()}


def _with_value(config, field: str, value: str, tmp_path: Path):
    """The config, run directory and working directory with ``value`` in ``field``."""
    config = copy.deepcopy(config)
    run_dir, workdir = tmp_path / "runs" / "r1", tmp_path / "work"
    if field == "extra_args":
        config.launcher.slurm.extra_args = [f"--comment={value}"]
    elif field == "out_dir":
        run_dir = tmp_path / "runs" / value
        config.trainer.out_dir = str(run_dir)
    elif field == "workdir":
        workdir = tmp_path / value
    else:
        setattr(config.launcher.slurm, field, value)
    return config, run_dir, workdir


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("field", FIELDS)
def test_a_value_is_refused_in_one_line_or_the_script_runs_only_what_it_means(composed, field, value, layout,
                                                                               tmp_path):
    config, run_dir, workdir = _with_value(composed[layout], field, value, tmp_path)
    try:
        validate(config)
        problem = script_problem(run_dir, workdir)
    except ConfigError as error:
        problem = str(error)
    if problem is not None:
        assert "\n" not in problem and ("out_dir" in problem if field == "out_dir" else True), problem
        assert field.replace("workdir", "current directory") in problem, problem
        assert any(ord(c) < 32 for c in value) or "\\" in value, f"a printable value was refused: {problem}"
        return
    script = job_script(config, run_dir, workdir, [str(tmp_path / "bin" / "ppctl")])
    assert read_sbatch_options(script) == sbatch_options(config, run_dir)
    calls = _run_with_stand_ins(script, workdir, tmp_path, nodes=config.launcher.nnodes)
    expected = ["train", "--config-dir", str(run_dir), "trainer.auto_resume=true"]
    if config.launcher.nnodes > 1:
        expected += ["launcher.node_rank=0", "launcher.rdzv_endpoint=n1:20042", "launcher.rdzv_id=ppctl-42"]
    assert calls["ppctl"] == [expected]
    assert [call[:3] for call in calls["srun"]] == [[f"--nodes={config.launcher.nnodes}", "--ntasks-per-node=1",
                                                     "--kill-on-bad-exit=1"]]
    assert not list(tmp_path.rglob(CANARY)), "a command planted in a value ran"


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("field", FIELDS)
def test_a_value_in_the_prepare_array_is_refused_in_one_line_or_the_task_runs_only_what_it_means(composed, field,
                                                                                                value, tmp_path):
    config, job_dir, workdir = _with_value(composed["one node"], field, value, tmp_path)
    config.trainer.out_dir = None  # the array's folder is --out, not a run directory
    try:
        validate(config)
        problem = script_problem(job_dir, workdir, "--out")
    except ConfigError as error:
        problem = str(error)
    if problem is not None:
        assert "\n" not in problem and field.replace("workdir", "current directory").replace("out_dir", "--out") \
            in problem, problem
        assert any(ord(c) < 32 for c in value) or "\\" in value, f"a printable value was refused: {problem}"
        return
    script = prepare_script(config, job_dir, workdir, 3, [str(tmp_path / "bin" / "ppctl")])
    assert read_sbatch_options(script) == prepare_options(config, job_dir, 3)
    calls = _run_with_stand_ins(script, workdir, tmp_path, nodes=1, array_task=2)
    assert calls["ppctl"] == [["prepare-data", "--config-dir", str(job_dir), "--task", "2", "--tasks", "3"]]
    assert [call[:3] for call in calls["srun"]] == [["--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1"]]
    assert not list(tmp_path.rglob(CANARY)), "a command planted in a value ran"


def test_a_control_character_is_refused_naming_its_field_before_anything_is_written(tmp_path):
    config = compose_config(["launcher=slurm", "data=synthetic"])
    config.launcher.slurm.partition = "gpu\ntouch pwned"
    with pytest.raises(ConfigError, match=r"^launcher.slurm.partition='gpu\\ntouch pwned' holds the control "
                                          r"character '\\n': ppctl submit writes it into the job script"):
        validate(config)
    assert script_problem(tmp_path / "a\nb", tmp_path).startswith("trainer.out_dir=")
    assert script_problem(tmp_path / "run", tmp_path / "a\tb").startswith("the current directory=")


def test_a_space_in_the_run_directory_is_one_output_option_and_percent_stays_literal(composed):
    run_dir = Path("/shared/my runs/100%")
    script = job_script(composed["one node"], run_dir, Path("/home/me"), ["/opt/ppctl"])
    assert '#SBATCH "--output=/shared/my runs/100%%/slurm-%j.out"' in script.splitlines()
    assert "--output=/shared/my runs/100%%/slurm-%j.out" in read_sbatch_options(script)


@pytest.mark.parametrize("lead, time, fragment", [
    (120, "2", "launcher.slurm.signal_lead_s=120 is not shorter than launcher.slurm.time=2 (120 s)"),
    (600, "00:05:00", "(300 s): the job would be told to stop before it starts working"),
    (90000, None, "launcher.slurm.signal_lead_s=90000 must be in 0..65535"),
])
def test_a_signal_lead_at_least_the_time_limit_is_refused(lead, time, fragment):
    overrides = ["launcher=slurm", "data=synthetic", f"launcher.slurm.signal_lead_s={lead}"]
    config = compose_config(overrides + ([f"launcher.slurm.time={time}"] if time else []))
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate(config)


@pytest.mark.parametrize("time, lead", [("1-00", 65535), ("0", 120), ("30", 120), ("10:00", 599)])
def test_a_signal_lead_inside_the_time_limit_or_no_limit_is_accepted(time, lead):
    validate(compose_config(["launcher=slurm", "data=synthetic", f"launcher.slurm.time={time}",
                             f"launcher.slurm.signal_lead_s={lead}"]))


def read_sbatch_options(script: str) -> list[str]:
    """The options sbatch takes from a script's ``#SBATCH`` lines, each line read by the rules of both sbatch
    script parsers Slurm has shipped (checked to agree): words split at unquoted blanks, a backslash makes the
    next character plain, ``#`` outside quotes (in the older parser, anywhere) starts a comment, ``"`` quotes (the
    newer parser: ``'`` too). sbatch stops at the first line that is neither blank nor a comment."""
    options = []
    for line in script.splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            newer, older = _words(line[7:], quotes="\"'", comment_in_quotes=False), _words(line[7:], '"', True)
            assert newer == older, f"the two parsers read {line!r} differently: {newer} / {older}"
            options += newer
    return options


def _words(text: str, quotes: str, comment_in_quotes: bool) -> list[str]:
    """``text`` split as one of sbatch's script parsers splits an ``#SBATCH`` line."""
    words, word, quote, escaped, started = [], "", None, False, False
    for char in text:
        if escaped:
            word, escaped, started = word + char, False, True
        elif char == "\\":
            escaped = True
        elif quote is not None and char == quote:
            quote = None
        elif quote is None and char in quotes:
            quote, started = char, True
        elif char == "#" and (quote is None or comment_in_quotes):
            break
        elif char.isspace() and quote is None:
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + char, True
    return words + ([word] if started else [])


def _run_with_stand_ins(script: str, workdir: Path, tmp_path: Path, nodes: int,
                       array_task: int | None = None) -> dict[str, list[list[str]]]:
    """Run the job script with bash, Slurm's commands and ppctl replaced by stand-ins that record their argv
    (srun then runs its command, as on one node), as the job or as task ``array_task`` of its array; the recorded
    calls by command."""
    bins, records = tmp_path / "bin", tmp_path / "calls"
    bins.mkdir()
    records.mkdir()
    for name in ("srun", "scontrol", "scancel", "ppctl"):
        body = {"srun": 'shift 3; exec "$@"', "scontrol": "echo n1"}.get(name, "")
        stand_in = bins / name
        stand_in.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" >> "{records}/{name}"; printf "\\n" >> '
                            f'"{records}/{name}.ends"\n{body}\n')
        stand_in.chmod(0o755)
    workdir.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {"PATH": f"{bins}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NODEID": "0"}
    if array_task is not None:
        env.update(SLURM_ARRAY_JOB_ID="40", SLURM_ARRAY_TASK_ID=str(array_task))
    done = subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return {name: _calls(records / name) for name in ("srun", "ppctl")}


def _calls(record: Path) -> list[list[str]]:
    """The argv of each call a stand-in recorded (NUL-separated words, one line in ``.ends`` per call)."""
    if not record.exists():
        return []
    words = record.read_text().split("\0")[:-1]
    ends = len((record.parent / f"{record.name}.ends").read_text().splitlines())
    if ends == 1:
        return [words]
    raise AssertionError(f"{record.name} ran {ends} times")
