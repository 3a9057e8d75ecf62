"""Experiment trackers (W&B, MLflow): a run's results, and a gate's, a judge's or a training
step's figures, logged as those stages finish; opt-in per run (``--track``, a ``tracking:``
block), never able to fail the stage. docs/tracking.md says what goes where."""

from shopsimrl.research.tracking.base import Redactor, TrackedRun, TrackerOutcome, Tracking
from shopsimrl.research.tracking.evaluation import track_evaluation
from shopsimrl.research.tracking.stages import (
    log_online_analysis,
    log_skill_stage,
    track_gate,
    track_judge,
    track_stage,
    track_training_step,
)

__all__ = [
    "Redactor",
    "TrackedRun",
    "TrackerOutcome",
    "Tracking",
    "log_online_analysis",
    "log_skill_stage",
    "track_evaluation",
    "track_gate",
    "track_judge",
    "track_stage",
    "track_training_step",
]
