"""The offline judge stage: a judge model's structured verdict on frozen episodes (docs/analysis.md §6).

- :mod:`.config`: ``JUDGE.yaml`` and the versioned rubric (instructions + the verdict's JSON Schema);
- :mod:`.call`: one episode judged through one forced tool call, with bounded repairs;
- :mod:`.local`: the resumable local stage (``judge_outputs.jsonl``);
- :mod:`.sharded`: plan → Indexed Job workers → reducer on the sharded layout;
- :mod:`.summary`: verdict distribution, agreement with the reward and the rule labels (Cohen's kappa).
"""
