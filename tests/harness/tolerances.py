"""The suite's tolerances are ppctl's own (``ppctl.verify.tolerance``, which ``ppctl verify`` reads too)."""

from ppctl.verify.tolerance import HALF_PRECISION_LOSS, TOLERANCES, UNIT_ROUNDOFF, Tolerance, tolerance_of

__all__ = ["HALF_PRECISION_LOSS", "TOLERANCES", "UNIT_ROUNDOFF", "Tolerance", "tolerance_of"]
