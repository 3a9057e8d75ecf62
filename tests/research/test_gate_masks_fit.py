"""Gate masks against literal golden vectors, and the paired-delta OLS against numpy and exact data."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from scipy import stats

from shopsimrl.research.gate.fit import GateFitError, check_design, fit_paired_delta_ols
from shopsimrl.research.gate.masks import MASK_THRESHOLD, Slot, chunk_bit, gate_a_assignments, online_assignments, slot_choice
from shopsimrl.schemas import EpisodeJob

CHUNKS = ("chunk-positive", "chunk-negative", "选规格")

# (task_id, sample_id) → Gate A mask over CHUNKS, mask seed 20260901, split val: each bit is
# sha256(f"20260901:val:{task}:{sample}:{chunk}")[:8] (big-endian) < 2**63, worked out once with
# hashlib by hand and written down here (the draws are in the comments).
GATE_A_GOLDEN = {
    (2, 0): (1, 1, 1),  # 0x7c5034baa47367a8 0x6ac81d59c2d1df5d 0x115c3fb3996777a1
    (2, 1): (1, 0, 1),  # 0x56eac5279ca64901 0xdb141d754640c86f 0x436cf16c247121b8
    (5, 0): (1, 0, 0),  # 0x493b2797c16692db 0xa51a01badd4a1293 0xf73ebcea7bb13f55
    (5, 1): (0, 1, 0),  # 0xb2c0914b68c56e05 0x0741689a3e87163c 0xbfdc0c89490971c8
    (11, 0): (0, 0, 0),  # 0x9ff661244a27c567 0x9960d04ccd7a54b7 0xd66f44ec03e8f0a9
    (11, 1): (1, 1, 0),  # 0x30998e78826500aa 0x7fb4c43b973057f5 0xf00fcc274d55d78e
    (12, 1): (0, 0, 1),  # 0xc392d2bd85fcb641 0xfd976773a2e85571 0x4960a388fb4fe137
}

# Online gate, mask seed 20260901, sample 0: slots chunk-a (versions chunk-a, rw-a1, rw-a2),
# chunk-b (chunk-b), cand-add (cand-add); choice = draw % (versions + 1), 0 = absent.
SLOTS = (
    Slot("chunk-a", ("chunk-a", "rw-a1", "rw-a2"), "chunk-a"),
    Slot("chunk-b", ("chunk-b",), "chunk-b"),
    Slot("cand-add", ("cand-add",), None),
)
ONLINE_GOLDEN = {  # task → (choices per slot, mask over columns, included)
    1: ((2, 1, 0), (0, 1, 0, 1, 0), ("rw-a1", "chunk-b")),
    4: ((3, 0, 0), (0, 0, 1, 0, 0), ("rw-a2",)),
    5: ((0, 0, 0), (0, 0, 0, 0, 0), ()),
    10: ((3, 1, 1), (0, 0, 1, 1, 1), ("rw-a2", "chunk-b", "cand-add")),
    12: ((1, 1, 1), (1, 0, 0, 1, 1), ("chunk-a", "chunk-b", "cand-add")),
}


def job(task_id: int, sample_id: int = 0) -> EpisodeJob:
    return EpisodeJob(task_id=task_id, sample_id=sample_id, seed=0, split="val")


def test_gate_a_bits_match_the_golden_vectors_and_the_formula() -> None:
    assert MASK_THRESHOLD == 2**63
    jobs = [job(task, sample) for task, sample in GATE_A_GOLDEN]
    assignments = gate_a_assignments(jobs, CHUNKS, 20260901)
    for assignment in assignments:
        key = (assignment.job.task_id, assignment.job.sample_id)
        assert assignment.mask == GATE_A_GOLDEN[key]
        assert assignment.included == tuple(c for c, bit in zip(CHUNKS, GATE_A_GOLDEN[key], strict=True) if bit)
        for chunk, bit in zip(CHUNKS, assignment.mask, strict=True):
            text = f"20260901:val:{key[0]}:{key[1]}:{chunk}".encode()
            assert bit == int(int.from_bytes(hashlib.sha256(text).digest()[:8], "big") < 2**63)
    # The seed, the split and the sample all enter the hash.
    assert chunk_bit(20260901, job(2, 1), "chunk-negative") == 0
    assert chunk_bit(20260902, job(2, 1), "chunk-negative") == int(
        int.from_bytes(hashlib.sha256(b"20260902:val:2:1:chunk-negative").digest()[:8], "big") < 2**63
    )
    row = assignments[1].to_dict()
    assert row == {
        "episode_id": "task-000002__sample-001",
        "task_id": 2,
        "sample_id": 1,
        "seed": 0,
        "split": "val",
        "mask": [1, 0, 1],
        "included_chunk_ids": ["chunk-positive", "选规格"],
    }


def test_online_slot_choices_match_the_golden_vectors() -> None:
    assignments = online_assignments([job(task) for task in ONLINE_GOLDEN], SLOTS, 20260901)
    for assignment in assignments:
        choices, mask, included = ONLINE_GOLDEN[assignment.job.task_id]
        for slot, choice in zip(SLOTS, choices, strict=True):
            text = f"20260901:val:{assignment.job.task_id}:0:{slot.slot_id}".encode()
            assert choice == int.from_bytes(hashlib.sha256(text).digest()[:8], "big") % (len(slot.versions) + 1)
            assert slot_choice(20260901, assignment.job, slot.slot_id, len(slot.versions)) == choice
            assert assignment.slot_states is not None
            assert assignment.slot_states[slot.slot_id] == (None if choice == 0 else slot.versions[choice - 1])
        assert (assignment.mask, assignment.included) == (mask, included)
    assert assignments[0].to_dict()["slot_states"] == {"chunk-a": "rw-a1", "chunk-b": "chunk-b", "cand-add": None}


# --------------------------------------------------------------------------- the fit


def test_no_intercept_and_zero_rows_are_kept() -> None:
    fit = fit_paired_delta_ols([[1, 0], [0, 1]] * 3, [0.3, -0.2] * 3)
    assert fit.coefficients == pytest.approx((0.3, -0.2), abs=1e-12)
    one = fit_paired_delta_ols([[0], [1], [1]], [0.8, 0.2, 0.4])
    assert one.coefficients == pytest.approx((0.3,), abs=1e-12)  # not 0.4 - 0.8: the zero row pulls it down


@pytest.mark.parametrize(
    ("masks", "values", "message"),
    [
        (
            [[1, 1], [1, 1], [0, 0]],
            [0.1, 0.2, 0.3],
            r"rank deficient \(rank 1 of 2 columns; always shown together: columns \[0, 1\]\)",
        ),
        ([[1, 0], [1, 0], [1, 0]], [0.1, 0.2, 0.3], r"rank deficient \(rank 1 of 2 columns; never shown: columns \[1\]\)"),
        ([[1, 0, 1], [0, 1, 1], [1, 0, 1], [0, 1, 1]], [0.0] * 4, r"rank deficient \(rank 2 of 3"),
        ([[1, 0], [0, 1]], [0.1, 0.2], r"more observations than columns: 2 rows for 2"),
        ([[1, 0], [0, 2], [1, 1]], [0.1, 0.2, 0.3], r"integers 0 and 1"),
        ([[1, 0], [0, 1], [1]], [0.1, 0.2, 0.3], r"rectangular"),
        ([[1], [0], [1]], [0.1, math.nan, 0.3], r"finite numbers"),
        ([[1], [0], [1]], [0.1, True, 0.3], r"finite numbers"),
    ],
)
def test_bad_designs_and_outcomes_are_refused(masks: list[list[int]], values: list[float], message: str) -> None:
    with pytest.raises(GateFitError, match=message):
        fit_paired_delta_ols(masks, values)


def test_the_design_check_is_the_fit_on_zeros() -> None:
    check_design([[1, 0], [0, 1], [0, 0]])
    with pytest.raises(GateFitError, match="rank deficient"):
        check_design([[1, 1], [1, 1], [0, 0]])


def hc2_by_hand(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """β and HC2 standard errors with explicit loops (no shared code with the module)."""
    xtx_inv = np.linalg.inv(x.T @ x)
    beta = np.linalg.lstsq(x, y, rcond=None)[0]
    meat = np.zeros((x.shape[1], x.shape[1]))
    for i in range(len(y)):
        h = float(x[i] @ xtx_inv @ x[i])
        e = float(y[i] - x[i] @ beta)
        meat += np.outer(x[i], x[i]) * e * e / (1.0 - h)
    return beta, np.sqrt(np.diag(xtx_inv @ meat @ xtx_inv))


@pytest.mark.parametrize("seed", range(12))
def test_random_designs_agree_with_numpy_least_squares(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(12, 300)), int(rng.integers(1, 9))
    masks = rng.integers(0, 2, size=(n, k))
    while np.linalg.matrix_rank(masks) < k:
        masks = rng.integers(0, 2, size=(n, k))
    y = masks @ rng.normal(0, 0.3, k) + rng.normal(0, 0.2, n)
    fit = fit_paired_delta_ols(masks.tolist(), y.tolist())
    beta, se = hc2_by_hand(masks.astype(float), y)
    assert np.allclose(fit.coefficients, beta, atol=1e-10)
    assert np.allclose([s for s in fit.standard_errors if s is not None], se, rtol=1e-9)
    t = stats.t.ppf(0.975, n - k)
    for index in range(k):
        interval = fit.intervals[index]
        assert interval is not None
        assert interval[0] == pytest.approx(beta[index] - t * se[index], abs=1e-9)
        assert interval[1] == pytest.approx(beta[index] + t * se[index], abs=1e-9)
    assert fit.degrees_of_freedom == n - k and fit.observations == n


def test_exact_effects_are_recovered_and_tiny_ones_snap_to_zero() -> None:
    rng = np.random.default_rng(7)
    masks = rng.integers(0, 2, size=(200, 4))
    truth = np.array([0.25, -0.4, 0.0, 3e-13])
    fit = fit_paired_delta_ols(masks.tolist(), (masks @ truth).tolist())
    assert fit.coefficients[:2] == pytest.approx((0.25, -0.4), abs=1e-12)
    assert fit.coefficients[2:] == (0.0, 0.0)
    assert fit.residual_sd == pytest.approx(0.0, abs=1e-12)
    assert all(se is not None and se < 1e-10 for se in fit.standard_errors)


def test_a_row_with_leverage_one_leaves_the_hc2_error_undefined() -> None:
    # Column 1 is shown once: that row alone determines its coefficient.
    fit = fit_paired_delta_ols([[1, 0], [1, 0], [0, 0], [1, 1]], [0.1, 0.3, 0.0, 0.9])
    assert fit.coefficients == pytest.approx((0.2, 0.7))
    assert fit.standard_errors == (None, None) and fit.intervals == (None, None)
