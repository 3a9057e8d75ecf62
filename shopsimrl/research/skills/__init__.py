"""Skills from traces: the skill builder's foundation (docs/skills.md).

``compact`` (what an analyst sees of a trace), ``firewall`` (leakage rules and the forced
NO_PROPOSAL rules), ``cards`` (the cards and their tool schemas), ``structured`` (one forced
tool call with bounded repair turns), ``prompts`` and ``analyst`` (the success analyst per
trajectory, resumable by input fingerprint).
"""
