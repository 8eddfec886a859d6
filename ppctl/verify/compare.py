"""``ppctl verify``'s judgement: two finished run directories compared by the tolerance rule.

Per step, the loss and the grad norm (``metrics.jsonl``: exact floats), the validation loss after the last
step, and every parameter of both final checkpoints read whole (any layout against one process). Scalars
are relative differences against ``Tolerance.relative``; a parameter's largest element difference is
measured against the bound AdamW's steps allow (``Tolerance.parameter_bound``, which needs each
parameter's step-0 gradient: the single process's, computed here in one step of ``run_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppctl.run.logging import METRICS_FILE, read_metrics
from ppctl.verify.tolerance import Tolerance


class VerifyError(RuntimeError):
    """A run directory cannot be compared (no metrics, no checkpoint); the message is one line."""


@dataclass(frozen=True)
class Row:
    """One quantity's verdict: its worst relative difference (and where), and the tolerance it is held to."""

    quantity: str
    worst: float
    tolerance: float
    where: str

    @property
    def equal(self) -> bool:
        """Within the tolerance."""
        return self.worst <= self.tolerance


@dataclass(frozen=True)
class ParameterDifference:
    """A parameter's largest element difference and the bound it is held to (their ratio ranks them)."""

    name: str
    difference: float
    bound: float

    @property
    def ratio(self) -> float:
        """Difference over bound (above 1: outside the tolerance)."""
        return self.difference / self.bound if self.bound else float("inf") if self.difference else 0.0


@dataclass(frozen=True)
class Verdict:
    """Every quantity's row and the parameter that differs most, against its bound."""

    rows: tuple[Row, ...]
    worst_parameter: ParameterDifference | None

    @property
    def equal(self) -> bool:
        """Every quantity within its tolerance."""
        return all(row.equal for row in self.rows)


def relative(actual: float, expected: float) -> float:
    """``|a - e| / |e|`` (the absolute difference where the expected value is 0)."""
    difference = abs(actual - expected)
    return difference / abs(expected) if expected else difference


def run_metrics(run_dir: Path, steps: int) -> tuple[list[dict], float | None]:
    """A run's ``steps`` training records in step order and its last validation loss; ``VerifyError`` when any is
    missing."""
    records = read_metrics(run_dir / METRICS_FILE)
    train = {record["step"]: record for record in records if "loss" in record}
    missing = [step for step in range(steps) if step not in train]
    if missing:
        raise VerifyError(f"{run_dir / METRICS_FILE}: no record of step {missing[0] + 1} (the run ended early?)")
    validation = [record["val_loss"] for record in records if "val_loss" in record]
    return [train[step] for step in range(steps)], (validation[-1] if validation else None)


def scalar_row(quantity: str, actual: list[float], expected: list[float], tolerance: Tolerance) -> Row:
    """The worst step of a per-step scalar."""
    differences = [relative(got, want) for got, want in zip(actual, expected)]
    step = max(range(len(differences)), key=differences.__getitem__)
    return Row(quantity, differences[step], tolerance.relative, f"step {step + 1}")


def scalar_rows(parallel_dir: Path, single_dir: Path, steps: int, tolerance: Tolerance) -> list[Row]:
    """Loss and grad norm per step, and the validation loss."""
    (parallel, parallel_val), (single, single_val) = run_metrics(parallel_dir, steps), run_metrics(single_dir, steps)
    rows = [scalar_row(quantity, [record[key] for record in parallel], [record[key] for record in single], tolerance)
            for quantity, key in (("loss", "loss"), ("grad norm", "grad_norm"))]
    if parallel_val is not None and single_val is not None:
        rows.append(Row("validation loss", relative(parallel_val, single_val), tolerance.relative,
                        f"after step {steps}"))
    return rows


def final_parameters(run_dir: Path, rule_for) -> dict:
    """Every parameter of a run's latest checkpoint, whole, by global name."""
    from ppctl.checkpoint.files import CheckpointError, latest_checkpoint
    from ppctl.checkpoint.hf_export import read_dense_model

    try:
        checkpoint = latest_checkpoint(run_dir)
    except CheckpointError as error:
        raise VerifyError(str(error)) from None
    if checkpoint is None:
        raise VerifyError(f"{run_dir}: no checkpoint (the run saved none?)")
    return read_dense_model(checkpoint, rule_for)


def parameter_differences(parallel: dict, single: dict, first_gradients: dict, bound_of) -> list[ParameterDifference]:
    """Each parameter's largest element difference, with its bound (``bound_of(expected, first_gradient)``);
    ``VerifyError`` when the two runs hold other parameters or shapes."""
    if set(parallel) != set(single):
        extra = sorted(set(parallel) ^ set(single))
        raise VerifyError(f"the runs' checkpoints hold different parameters ({', '.join(extra[:3])}): not the same "
                          f"model")
    found = []
    for name, expected in single.items():
        actual = parallel[name]
        if actual.shape != expected.shape:
            raise VerifyError(f"parameter {name}: shape {list(actual.shape)} against {list(expected.shape)} in one "
                              f"process: not the same model")
        gradient = first_gradients.get(name)
        bound = bound_of(expected, gradient if gradient is not None else expected.new_zeros(()))
        found.append(ParameterDifference(name, (actual.double() - expected.double()).abs().max().item(), bound))
    return found


def parameter_row(differences: list[ParameterDifference], tolerance: Tolerance) -> tuple[Row, ParameterDifference]:
    """The parameters' row (the worst ratio of difference to bound, held to 1) and the worst parameter."""
    worst = max(differences, key=lambda entry: entry.ratio)
    return Row("parameters", worst.ratio, 1.0, worst.name), worst  # worst: difference / bound, held to 1


def judge(parallel_dir: Path, single_dir: Path, single_config, steps: int) -> Verdict:
    """The verdict on two finished runs of ``steps`` steps; ``single_config``: the single process's (resolved)
    config, whose precision sets the tolerance and whose optimizer the parameter bound."""
    from ppctl.model.family import resolve_model
    from ppctl.run.reference import run_reference
    from ppctl.verify.tolerance import tolerance_of

    tolerance = tolerance_of(single_config.trainer.precision)
    rows = scalar_rows(parallel_dir, single_dir, steps, tolerance)
    rules, vocab = resolve_model(single_config).rules, single_config.model.vocab_size
    first_gradients = run_reference(single_config, 1).first_gradients  # step 0's, as the single run took it
    optimizer = single_config.optimizer

    def bound_of(expected, gradient) -> float:
        return tolerance.parameter_bound(expected, gradient, steps, optimizer.lr, optimizer.eps)

    parallel, single = (_real_rows(final_parameters(run_dir, rules), rules, vocab)
                        for run_dir in (parallel_dir, single_dir))
    row, worst = parameter_row(parameter_differences(parallel, single, _real_rows(first_gradients, rules, vocab),
                                                     bound_of), tolerance)
    return Verdict((*rows, row), worst)


def _real_rows(tensors: dict, rules, vocab: int) -> dict:
    """``tensors`` with vocabulary rows beyond the real vocabulary (TP padding, which differs by layout) cut."""
    return {name: tensor[:vocab] if rules(name).vocab_rows else tensor for name, tensor in tensors.items()}
