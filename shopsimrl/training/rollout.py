"""One training rollout: the evaluation's episode engine with the token adapter → trace and samples.

:class:`TrainingRollouts` runs an episode exactly as evaluation does (:class:`shopsimrl.episode.
AgentRuntime`: page tools, protocol errors and their repair turns, the length and context policy
failures, the action limit, skills, the lease released on every path), with the model reached
through a :class:`~shopsimrl.training.token_model.TokenSession` of its own. What comes back is
the episode's v4 trace, unchanged in shape (its ``provenance.model`` names the token endpoint and
the tokenizer; no token ids, masks or log-probs are in it), and the trainer's samples built from
the session's calls (:func:`~shopsimrl.training.trajectory.episode_samples`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shopsimrl.environment import ShopEnvironment
from shopsimrl.episode import AgentRuntime
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records import EpisodeTrace
from shopsimrl.schemas import EpisodeJob
from shopsimrl.skills import SkillProvider
from shopsimrl.training.samples import Sample
from shopsimrl.training.token_model import TokenModel, TurnRecord
from shopsimrl.training.trajectory import Trajectory, episode_samples

__all__ = ["EpisodeRollout", "TrainingRollouts"]


@dataclass
class EpisodeRollout:
    trace: EpisodeTrace
    """The v4 evaluation record of the episode (no training fields)."""
    samples: list[Sample]
    turns: list[TurnRecord]
    trajectory: Trajectory | None
    scored: bool


class TrainingRollouts:
    """Episodes for a trainer; safe to share across concurrent episodes (one session each)."""

    def __init__(
        self,
        *,
        model: TokenModel,
        environment: ShopEnvironment,
        prompts: PromptBuilder,
        skills: SkillProvider,
        max_steps: int = 30,
    ) -> None:
        self.model = model
        self.environment = environment
        self.prompts = prompts
        self.skills = skills
        self.max_steps = max_steps

    async def run(
        self,
        job: EpisodeJob,
        *,
        index: int,
        group_index: int | None = None,
        rollout_id: int | None = None,
        metadata: dict[str, Any] | None = None,
        skills: SkillProvider | None = None,
    ) -> EpisodeRollout:
        """Play ``job`` once. Never raises for an episode-level failure: the trace says what
        happened and the samples are the abort placeholder when the episode has no score.
        ``skills`` replaces the shared provider for this episode (a group's curriculum draw)."""
        session = self.model.session(f"{job.episode_id}-{index}")
        runtime = AgentRuntime(
            model=session,
            environment=self.environment,
            prompts=self.prompts,
            skills=skills or self.skills,
            max_steps=self.max_steps,
        )
        trace = await runtime.run(job)
        built = episode_samples(
            trace, session.turns, index=index, group_index=group_index, rollout_id=rollout_id, metadata=metadata
        )
        return EpisodeRollout(
            trace=trace, samples=built.samples, turns=list(session.turns), trajectory=built.trajectory, scored=built.scored
        )
