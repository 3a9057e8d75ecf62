"""Skill gates: paired val rollouts that estimate what each skill chunk is worth (docs/paired_validation.md)."""
