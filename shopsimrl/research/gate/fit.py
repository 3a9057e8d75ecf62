"""The paired-delta OLS of a skill gate: ``R_i − B_i = C_iᵀβ + ε_i``, no intercept.

``C_i`` is the 0/1 mask of rollout *i* (not centred, no constant column; all-zero rows are
observations like any other), ``R_i − B_i`` its outcome minus the same task's bare outcome. One
fit per metric (``reward`` and every ``r_*``).

As in the earlier implementation: more rows than columns, binary rectangular masks and finite
outcomes are required; a design whose columns are linearly dependent is an error (checked
before any rollout by fitting zeros); coefficients with ``|β| ≤ 1e-12`` are reported as 0; the
intercept is fixed metadata (0.0), not an estimate.

Beyond it: each coefficient has a standard error and a 95 % interval. The standard error is
heteroskedasticity-consistent (HC2: ``(XᵀX)⁻¹ Xᵀ diag(e_i² / (1 − h_ii)) X (XᵀX)⁻¹``), because the
spread of a delta depends on which chunks were shown (a main-effects model leaves interactions in
the residual); the interval is ``β ± t(0.975, n − k) · SE``. Where a row has leverage 1 (one
rollout alone determines a coefficient) HC2 is undefined and the SE and interval are null.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from shopsimrl.metrics import student_t_quantile

__all__ = [
    "CONFIDENCE",
    "STANDARD_ERROR",
    "ZERO_TOLERANCE",
    "Fit",
    "GateFitError",
    "check_design",
    "fit_paired_delta_ols",
]

ZERO_TOLERANCE: Final = 1e-12
CONFIDENCE: Final = 0.95
STANDARD_ERROR: Final = "HC2"
_LEVERAGE_ONE: Final = 1.0 - 1e-9


class GateFitError(ValueError):
    """The design or the outcomes cannot be fitted (rank deficient, too few rows, bad values)."""


@dataclass(frozen=True)
class Fit:
    coefficients: tuple[float, ...]
    standard_errors: tuple[float | None, ...]
    intervals: tuple[tuple[float, float] | None, ...]
    observations: int
    degrees_of_freedom: int
    residual_sd: float

    def column(self, index: int) -> dict[str, Any]:
        interval = self.intervals[index]
        return {
            "coefficient": self.coefficients[index],
            "standard_error": self.standard_errors[index],
            "ci_low": None if interval is None else interval[0],
            "ci_high": None if interval is None else interval[1],
        }


def _design(masks: Sequence[Sequence[int]]) -> np.ndarray:
    if not masks:
        raise GateFitError("no observations to fit")
    width = len(masks[0])
    if width < 1 or any(len(row) != width for row in masks):
        raise GateFitError("the mask matrix must be rectangular with at least one column")
    if any(value not in (0, 1) or isinstance(value, bool) for row in masks for value in row):
        raise GateFitError("mask values must be the integers 0 and 1")
    if len(masks) <= width:
        raise GateFitError(f"OLS needs more observations than columns: {len(masks)} rows for {width} columns")
    design = np.asarray(masks, dtype=np.float64)
    rank = int(np.linalg.matrix_rank(design))
    if rank < width:
        zero = [index for index in range(width) if not design[:, index].any()]
        twins = [(a, b) for a in range(width) for b in range(a + 1, width) if (design[:, a] == design[:, b]).all()]
        hint = f"; never shown: columns {zero}" if zero else f"; always shown together: columns {list(twins[0])}" if twins else ""
        raise GateFitError(
            f"the mask design is rank deficient (rank {rank} of {width} columns{hint}); use another mask seed or more tasks"
        )
    return design


def check_design(masks: Sequence[Sequence[int]]) -> None:
    """Fail before any rollout when the frozen masks cannot be fitted (the fit on zeros)."""
    fit_paired_delta_ols(masks, [0.0] * len(masks))


def fit_paired_delta_ols(masks: Sequence[Sequence[int]], values: Sequence[float]) -> Fit:
    """Fit the deltas ``values`` (``R_i − B_i``, never raw rewards) on ``masks``."""
    design = _design(masks)
    if len(values) != len(design):
        raise GateFitError(f"{len(values)} outcomes for {len(design)} mask rows")
    if any(isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) for value in values):
        raise GateFitError("OLS outcomes must be finite numbers")
    y = np.asarray(values, dtype=np.float64)
    n, k = design.shape
    gram_inverse = np.linalg.inv(design.T @ design)
    beta = gram_inverse @ (design.T @ y)
    residuals = y - design @ beta
    leverage = np.einsum("ij,jk,ik->i", design, gram_inverse, design)
    dof = n - k
    residual_sd = float(math.sqrt(float(residuals @ residuals) / dof))
    coefficients = tuple(0.0 if abs(float(b)) <= ZERO_TOLERANCE else float(b) for b in beta)
    if bool((leverage >= _LEVERAGE_ONE).any()):
        errors: tuple[float | None, ...] = (None,) * k
    else:
        weights = residuals**2 / (1.0 - leverage)
        covariance = gram_inverse @ (design.T * weights) @ design @ gram_inverse
        errors = tuple(float(math.sqrt(max(float(v), 0.0))) for v in np.diag(covariance))
    quantile = student_t_quantile(0.5 + CONFIDENCE / 2, dof)
    intervals = tuple(
        None if se is None else (coefficient - quantile * se, coefficient + quantile * se)
        for coefficient, se in zip(coefficients, errors, strict=True)
    )
    return Fit(coefficients, errors, intervals, n, dof, residual_sd)
