"""The project's training sample: slime's ``Sample`` field contract, without importing slime.

slime (THUDM/slime, ``slime/utils/types.py``) trains on ``Sample`` objects; its custom-generate
function returns them (``async def generate(args, sample, sampling_params) -> Sample |
list[Sample]``). slime needs torch and Ray and runs only inside its own process, so the project
builds its own record, :class:`Sample`, with the fields slime reads, and converts at the edge
(:meth:`Sample.to_slime`, which imports slime only when called). The field contract:

==================  ===============================================================================
field               meaning
==================  ===============================================================================
tokens              prompt ids, then the response: every id the model sampled and the template,
                    tool-result and observation ids between its turns, exactly as sent and sampled
response_length     ids after the prompt; ``len(loss_mask) == response_length``
loss_mask           per response id: 1 sampled by the model, 0 anything else
rollout_log_probs   per response id: the sampler's log-probability (finite) where the mask is 1,
                    0.0 where it is 0
reward              ``{"reward", "r_*"...}``: the environment's reward and every ``r_*`` component
                    (slime reads the scalar through ``--reward-key reward``)
status              COMPLETED; TRUNCATED (the episode ended on ``generation_length``); ABORTED (a
                    technical failure: the abort placeholder, with ``remove_sample`` true)
rollout_id          one per episode; sibling samples of a forked trajectory share it (slime keeps
                    them together and averages the loss per rollout)
group_index, index  slime's: the prompt group and the sample's index
remove_sample       true only for the abort placeholder (slime zeroes its loss mask)
metadata            task, sample, episode id, skills, the episode's status, forks, siblings
==================  ===============================================================================

:meth:`Sample.check` asserts the invariants on one sample; :func:`check_siblings` those of an
episode's samples (one reward, one rollout id).
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CURRICULUM",
    "CURRICULUM_MODES",
    "Sample",
    "SampleContractError",
    "SampleStatus",
    "abort_sample",
    "check_siblings",
    "curriculum_of",
]

ABORT_TOKENS = (0, 0)
"""The placeholder's tokens: a one-id prompt and a one-id response, masked (the earlier adapter's shape)."""

# The curriculum's draw for a sample's group, in ``Sample.metadata`` (every sample of a group
# carries the same): ``metadata[CURRICULUM] = {"state_id", "group_key", "mode", "skill_ids",
# "q", "rho"}`` (:meth:`shopsimrl.training.curriculum.SkillAssignment.to_dict` writes it; triage
# and the rollout metrics read it through :func:`curriculum_of`).
CURRICULUM = "curriculum"
CURRICULUM_MODES = ("skill_free", "assisted", "assisted_empty")


def curriculum_of(metadata: Any) -> dict[str, Any] | None:
    """A sample's curriculum draw as ``{"state_id", "mode", "chunks", "q", "rho"}``; None when the
    sample carries none (no curriculum, or a diagnostic's ``full`` mode)."""
    draw = metadata.get(CURRICULUM) if isinstance(metadata, dict) else None
    if not isinstance(draw, dict) or draw.get("mode") not in CURRICULUM_MODES:
        return None
    return {
        "state_id": draw.get("state_id"),
        "mode": draw["mode"],
        "chunks": list(draw.get("skill_ids") or []),
        "q": draw.get("q"),
        "rho": dict(draw.get("rho") or {}),
    }


class SampleStatus(enum.Enum):
    """slime's ``Sample.Status`` values that a rollout here ends in."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


class SampleContractError(ValueError):
    """A sample breaks the field contract (module docstring); the message names the field."""


@dataclass
class Sample:
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    reward: dict[str, float]
    status: SampleStatus
    rollout_id: int
    group_index: int | None = None
    index: int | None = None
    remove_sample: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def check(self) -> None:
        """Raise :class:`SampleContractError` naming the first field that breaks the contract."""
        n = self.response_length
        if not 0 < n <= len(self.tokens) - 1:
            raise SampleContractError(f"response_length {n} must be in 1..len(tokens) - 1 = {len(self.tokens) - 1}")
        if len(self.loss_mask) != n:
            raise SampleContractError(f"loss_mask has {len(self.loss_mask)} entries, response_length is {n}")
        if len(self.rollout_log_probs) != n:
            raise SampleContractError(f"rollout_log_probs has {len(self.rollout_log_probs)} entries, response_length is {n}")
        if any(bit not in (0, 1) for bit in self.loss_mask):
            raise SampleContractError("loss_mask holds a value other than 0 and 1")
        for position, (bit, value) in enumerate(zip(self.loss_mask, self.rollout_log_probs, strict=True)):
            if not math.isfinite(value):
                raise SampleContractError(f"rollout_log_probs[{position}] is not finite: {value!r}")
            if bit == 0 and value != 0.0:
                raise SampleContractError(f"rollout_log_probs[{position}] is {value!r} where loss_mask is 0 (must be 0.0)")
        if not isinstance(self.reward, dict) or "reward" not in self.reward:
            raise SampleContractError("reward must be a dict with a 'reward' key")
        if self.status is SampleStatus.ABORTED:
            if not self.remove_sample or any(self.loss_mask):
                raise SampleContractError("an ABORTED sample must have remove_sample true and no trainable token")
        elif self.remove_sample or not any(self.loss_mask):
            raise SampleContractError(f"a {self.status.name} sample must keep remove_sample false and hold a trainable token")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, for the training namespace beside a trace."""
        return {
            "tokens": list(self.tokens),
            "response_length": self.response_length,
            "loss_mask": list(self.loss_mask),
            "rollout_log_probs": list(self.rollout_log_probs),
            "reward": dict(self.reward),
            "status": self.status.value,
            "rollout_id": self.rollout_id,
            "group_index": self.group_index,
            "index": self.index,
            "remove_sample": self.remove_sample,
            "metadata": copy.deepcopy(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """The inverse of :meth:`to_dict` (a line of the training namespace); checked."""
        try:
            sample = cls(
                tokens=[int(t) for t in data["tokens"]],
                response_length=int(data["response_length"]),
                loss_mask=[int(bit) for bit in data["loss_mask"]],
                rollout_log_probs=[float(v) for v in data["rollout_log_probs"]],
                reward={str(k): float(v) for k, v in data["reward"].items()},
                status=SampleStatus(data["status"]),
                rollout_id=int(data["rollout_id"]),
                group_index=data.get("group_index"),
                index=data.get("index"),
                remove_sample=bool(data.get("remove_sample", False)),
                metadata=dict(data.get("metadata") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SampleContractError(f"not a training sample record: {exc!r}") from exc
        sample.check()
        return sample

    def to_slime(self, base: Any | None = None) -> Any:
        """slime's ``Sample`` with these fields (a copy of ``base``, the sample slime handed in,
        keeps its prompt, label and the rest). Imports slime here: call it in slime's process."""
        # Imported here, not at the top: slime (torch, Ray) exists only in the trainer's process.
        try:
            from slime.utils.types import Sample as SlimeSample  # type: ignore[import-not-found]  # not installed outside the trainer
        except ImportError as exc:
            raise RuntimeError(
                "converting to slime's Sample needs slime (slime.utils.types); call to_slime inside slime's rollout process"
            ) from exc
        sample = copy.copy(base) if base is not None else SlimeSample()
        sample.tokens = list(self.tokens)
        sample.response_length = self.response_length
        sample.loss_mask = list(self.loss_mask)
        sample.rollout_log_probs = list(self.rollout_log_probs)
        sample.reward = dict(self.reward)
        sample.status = SlimeSample.Status(self.status.value)
        sample.remove_sample = self.remove_sample
        if self.group_index is not None:
            sample.group_index = self.group_index
        if self.index is not None:
            sample.index = self.index
        sample.metadata = {**(getattr(base, "metadata", None) or {}), **copy.deepcopy(self.metadata)}
        # A dataclass field in newer slime, a plain attribute that its converters read in older ones.
        sample.rollout_id = self.rollout_id
        return sample


def abort_sample(*, rollout_id: int, group_index: int | None, index: int | None, metadata: dict[str, Any]) -> Sample:
    """The placeholder for an episode that failed for a technical reason: slime removes it
    (``remove_sample``), so the trainer never learns from a zero reward nobody earned."""
    return Sample(
        tokens=list(ABORT_TOKENS),
        response_length=1,
        loss_mask=[0],
        rollout_log_probs=[0.0],
        reward={"reward": 0.0, "r_strict": 0.0, "r_success": 0.0},
        status=SampleStatus.ABORTED,
        rollout_id=rollout_id,
        group_index=group_index,
        index=index,
        remove_sample=True,
        metadata={**metadata, "scored": False},
    )


def check_siblings(samples: Sequence[Sample]) -> None:
    """The samples of one episode: each checked, one rollout id, one reward, one status."""
    if not samples:
        raise SampleContractError("an episode gives at least one sample")
    for sample in samples:
        sample.check()
    first = samples[0]
    for position, sample in enumerate(samples[1:], start=1):
        if sample.rollout_id != first.rollout_id:
            raise SampleContractError(f"sibling {position} has rollout_id {sample.rollout_id}, sibling 0 has {first.rollout_id}")
        if sample.reward != first.reward:
            raise SampleContractError(f"sibling {position} has reward {sample.reward}, sibling 0 has {first.reward}")
        if sample.status is not first.status:
            raise SampleContractError(f"sibling {position} has status {sample.status.name}, sibling 0 has {first.status.name}")
