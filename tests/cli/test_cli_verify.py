"""End to end: ``ppctl verify`` proves a layout equal to one process, names what differs when a parallel feature is
broken, and refuses in one line what it cannot compare.

One launch pair proves Llama 3 8B's layout (8 of its layers) at tp=2 pp=2 under zbv, shrunk (``--shrink``) to the
smallest model that layout allows; the broken twin is a tensor-parallel run whose column-parallel input gradient is not all-reduced
(``tests/distributed/breakers.py``, installed in every process of that verify by ``tests/cli/defects``): verify must
exit 1 naming the grad norm. The refusals start nothing.
"""

import json
import os

import pytest
from typer.testing import CliRunner

from tests.cli.conftest import REPO

pytestmark = [pytest.mark.cli, pytest.mark.timeout(400)]


def _verify(ppctl, tmp_path, *args, steps=2, env=None):
    result = ppctl("verify", *args, "--steps", str(steps), "--json", "--out", str(tmp_path / "verify"), env=env)
    return result, (json.loads(result.stdout) if result.stdout.strip() else None)


def test_a_shrunk_llama3_8b_layout_is_proven_equal_to_one_process(ppctl, tmp_path):
    # Llama 3 8B's widths and vocabulary at 4 of its 32 layers, one per stage (the suite's budget: the shrink keeps
    # every layer)
    result, report = _verify(ppctl, tmp_path, "model=llama3_8b", "model.num_layers=4", "parallel.tp=2",
                             "parallel.pp=2", "schedule=zbv", "--shrink")
    assert result.returncode == 0, result.stderr[-2000:]
    assert report["equal"] and [row["quantity"] for row in report["rows"]] == [
        "loss", "grad norm", "validation loss", "parameters"]
    assert all(row["worst"] <= row["tolerance"] for row in report["rows"])
    assert report["worst_parameter"]["difference"] <= report["worst_parameter"]["bound"]
    assert report["shrunk"][0].startswith("hidden 4096 -> 256 (32 heads of 8)")
    assert any("4 layers" in line for line in report["shrunk"])
    for name in ("parallel", "single"):
        assert (tmp_path / "verify" / name / "metrics.jsonl").is_file()


def test_a_broken_tensor_parallel_reduction_makes_verify_exit_1_naming_the_grad_norm(ppctl, tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "cli" / "defects"), str(REPO)]),
           "PPCTL_TEST_DEFECT": "tp_gradient_not_reduced"}
    result, report = _verify(ppctl, tmp_path, "data=synthetic", "parallel.tp=2", "parallel.pp=1", steps=1, env=env)
    assert result.returncode == 1, result.stderr[-2000:]
    differing = {row["quantity"] for row in report["rows"] if not row["equal"]}
    assert "grad norm" in differing and not report["equal"]


@pytest.mark.parametrize("args, said", [
    (["model=llama3_8b", "data=synthetic"], "needs"),
    (["data=synthetic", "--precision", "bf16"], "--precision bf16: choose fp64 or fp32"),
    (["data=synthetic", "parallel.tp=3"], "parallel.tp"),
])
def test_what_verify_cannot_compare_is_refused_in_one_line_before_anything_starts(ppctl, tmp_path, args, said):
    result = ppctl("verify", *args, "--out", str(tmp_path / "verify"))
    assert result.returncode == 2 and said in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "verify").exists()


def test_verify_on_several_nodes_needs_one_shared_out_directory(ppctl, tmp_path):
    """Each node's part of the parallel run writes into ``--out``: without one every node would pick its own."""
    result = ppctl("verify", "data=synthetic", "launcher.nnodes=2", "launcher.rdzv_endpoint=localhost:29500",
                   cwd=tmp_path)
    assert result.returncode == 2 and "verify on launcher.nnodes=2 needs --out DIR" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "runs").exists()


def _invoke(*args: str):
    """``ppctl ARGS`` in this process: the result (exit code, stdout, stderr apart). For refusals: nothing starts."""
    from ppctl.cli.app import app

    return CliRunner().invoke(app, list(args))


def test_shrink_refuses_a_model_read_from_a_folder(tmp_path):
    # The folder's weights fix the widths: shrunk, the run was refused for a width --shrink chose, not the user
    from tests.harness.hf_models import overrides, save_tiny

    folder = save_tiny(tmp_path / "gpt2")
    result = _invoke("verify", *overrides(folder), "--shrink", "--out", str(tmp_path / "verify"))
    assert (result.exit_code, result.stdout, result.stderr.splitlines()) == (2, "", [
        f"error: --shrink with model.init_from={folder}: the folder's weights fix the model's widths and "
        f"vocabulary, which --shrink would change; verify the folder's model as it is (drop --shrink), or this "
        f"layout on random weights of the smallest model (drop model.init_from)"])
    assert not (tmp_path / "verify").exists()


def test_the_folder_of_an_earlier_verify_is_refused_and_left_as_it_was(tmp_path):
    out = tmp_path / "verify"
    out.mkdir()
    (out / "parallel.log").write_text("the earlier verify's output\n")
    (out / "single").mkdir()
    result = _invoke("verify", "data=synthetic", "--out", str(out))
    assert (result.exit_code, result.stdout, result.stderr.splitlines()) == (2, "", [
        f"error: --out {out} holds an earlier verify ({out / 'parallel.log'}), which this one would overwrite; give "
        f"each verify a folder of its own (a new --out DIR, or no --out for a new runs/verify-<timestamp>)"])
    assert (out / "parallel.log").read_text() == "the earlier verify's output\n"
    assert sorted(path.name for path in out.iterdir()) == ["parallel.log", "single"]
