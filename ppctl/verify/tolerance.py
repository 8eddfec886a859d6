"""How close a parallel run must come to one process: the one place the tolerances are set (the suite's
equivalence tests and ``ppctl verify`` both read them).

A parallel run computes the same math as one process in another order: a matmul split
over TP ranks, a loss summed over microbatches and DP ranks, attention over CP chunks.
So do two CPUs running one process (AVX512, AVX2 and scalar kernels sum in other orders).
The tolerances below follow from that arithmetic, not from one machine's kernels.

Before the optimizer (losses, grad norms, gradients). Reordering a sum of ``n`` terms changes
it by at most ``n * u`` relative to the sum of their magnitudes (``u``: the unit roundoff),
about ``sqrt(n) * u`` in practice. The longest sums here (a microbatch's tokens times the
hidden size, the vocabulary, the microbatches of a step) have 10^3 to 10^4 terms, so
``sqrt(n) * u`` is at most ~100 u: float32's 1e-5 is 168 u. Float64's 1e-10 is far looser
than its roundoff needs (~10^6 u) and still 10^4 below the smallest defect the harness's
broken twins show (tests/distributed/test_harness_twins.py): float64 runs carry the
exactness claims, elementwise.

After the optimizer (parameters). AdamW moves each element by ``lr * m / (sqrt(v) + eps)``;
where the true gradient is ~0 (a dead unit, a token absent from the batch) that step is
``lr * g / (|g| + eps)``, whose slope in ``g`` is up to ``1 / eps``: a gradient difference
``d`` the check above admits becomes a parameter difference of up to ``2 * lr * d / eps``
per step. A parameter element may therefore differ by
``rtol * max|p| + steps * lr * 2 * rtol * max|g| / eps`` (``max|g|``: the largest step-0
gradient element of that tensor in the single-process run). With float32, lr 1e-2 and eps
1e-5 the second term is what lets AVX512's kernels pass (the measured parameter difference
was 1.5e-6), while a missed, doubled or misplaced update (of order ``lr`` per element) still
fails: tests/distributed/test_harness_twins.py shows it in both precisions.

On CUDA the same rule holds with TF32 off (``torch.backends.cuda.matmul.allow_tf32 = False``
and ``torch.backends.cudnn.allow_tf32 = False``): TF32 keeps 10 mantissa bits (u = 2^-11),
so a TF32 matmul is a half-precision comparison, not an equivalence. bf16 (u = 2^-8) and fp16
(u = 2^-11) runs are compared with the fp32 run of the same layout by ``HALF_PRECISION_LOSS``,
over a whole trajectory rather than one step.
"""

from __future__ import annotations

from dataclasses import dataclass

UNIT_ROUNDOFF = {"fp64": 2.0 ** -53, "fp32": 2.0 ** -24, "tf32": 2.0 ** -11, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
# Loss of a half-precision run against the fp32 run of the same layout, every step of a 30-step
# trajectory: a few units of the half precision's roundoff (bf16 2.5 u, fp16 4 u), far below what
# a wrong cast, a half-precision loss or half-precision gradient accumulation shows.
HALF_PRECISION_LOSS = {"bf16": 1e-2, "fp16": 2e-3}


@dataclass(frozen=True)
class Tolerance:
    """The relative tolerance of one precision, and how tensors are measured against it.

    ``elementwise``: every element, ``max |a - e| / max |e|`` (float64); otherwise the tensor
    norm, ``||a - e|| / ||e||`` (float32: an element whose true value is ~0 is pure roundoff).
    """

    relative: float
    elementwise: bool

    def allows_scalar(self, actual: float, expected: float) -> bool:
        """A loss or a grad norm: ``|a - e| <= relative * |e|``."""
        return abs(actual - expected) <= self.relative * abs(expected)

    def tensor_difference(self, actual, expected) -> float:
        """The relative difference of two tensors (0 for equal ones), in this tolerance's measure."""
        difference = actual.double() - expected.double()
        if self.elementwise:
            return difference.abs().max().item() / (expected.abs().max().item() or 1.0)
        return difference.norm().item() / (expected.double().norm().item() or 1.0)

    def parameter_bound(self, expected, first_gradient, steps: int, lr: float,
                        eps: float) -> float:
        """The largest element difference a parameter may show after ``steps`` AdamW steps (see the module)."""
        amplified = steps * lr * 2.0 * self.relative * first_gradient.abs().max().item() / eps
        return self.relative * expected.abs().max().item() + amplified


TOLERANCES = {"fp64": Tolerance(1e-10, elementwise=True), "fp32": Tolerance(1e-5, elementwise=False)}


def tolerance_of(precision: str) -> Tolerance:
    """The equivalence tolerance of a run's ``trainer.precision`` (fp32 or fp64)."""
    if precision not in TOLERANCES:
        raise ValueError(f"no equivalence tolerance for {precision}: compare half precision with HALF_PRECISION_LOSS")
    return TOLERANCES[precision]
