"""Skill markers: how the heuristic policy responds to skill chunks in its system prompt.

A served LLM reads skill text and may change its behaviour; the rule-based policy stands in for
that with a few documented markers, so a skill gate over chunks that carry them has known true
effects (docs/testbed.md, "Skills"). The runtime renders each selected skill into the system
message as ``<skill id="…" version="…">`` … ``</skill>`` (:func:`shopsimrl.prompts.render_skills`);
a marker counts only inside such a block, never in the base prompt or the user profile.

- ``[[testbed:choose-options]]`` — choosing the options the user wants is a skill the policy has
  only when told. It matters only where the policy runs with ``options_need_skill`` (the knob
  ``SHOPSIM_POLICY_OPTIONS_NEED_SKILL=1``): without the marker the policy then selects the first
  value of every axis and never leaves a product for an option value it lacks; with it, the
  policy behaves as it does by default. A helpful chunk.
- ``[[testbed:buy-first]]`` — open the first listed result, never go back from it, ignore the
  budget, and buy as soon as every axis has a value. A harmful chunk.

Skill text without a marker changes nothing: the policy's decisions depend on the system message
only through the user profile, so a chunk without a marker is an exact no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = ["BUY_FIRST", "CHOOSE_OPTIONS", "SkillMarkers", "skill_markers"]

CHOOSE_OPTIONS: Final = "[[testbed:choose-options]]"
BUY_FIRST: Final = "[[testbed:buy-first]]"

# The renderer writes the opening tag on its own line and the content after it; ids and versions
# are JSON strings, so the tag ends at the first '>' after its quoted attributes.
_SKILL_BLOCK = re.compile(r'<skill id="(?:[^"\\]|\\.)*" version="(?:[^"\\]|\\.)*">\n(.*?)\n</skill>', re.S)


@dataclass(frozen=True, slots=True)
class SkillMarkers:
    """What the skills in one system prompt ask of the policy."""

    choose_options: bool = True
    """Select the options the user wants (off only with ``options_need_skill`` and no marker)."""
    buy_first: bool = False


def skill_markers(system_text: str, *, options_need_skill: bool = False) -> SkillMarkers:
    """The markers of the skill blocks in ``system_text`` (the system messages, joined)."""
    contents = _SKILL_BLOCK.findall(system_text)
    return SkillMarkers(
        choose_options=not options_need_skill or any(CHOOSE_OPTIONS in content for content in contents),
        buy_first=any(BUY_FIRST in content for content in contents),
    )
