"""Training rollouts with the evaluation's episode engine: exact tokens for a trainer (slime).

The episode engine (:mod:`shopsimrl.episode`) is the one evaluation runs; a training rollout
differs only in how the model is called and what comes back to the trainer:

- :mod:`shopsimrl.training.chat`: what the adapter needs of a tokenizer (messages and tools →
  prompt ids, ids → text) and the parser of a reply's text (thinking, ``<tool_call>`` blocks);
- :mod:`shopsimrl.training.token_model`: the token-level model adapter, a ``ChatModel`` over
  SGLang's ``POST /generate`` that keeps every call's prompt ids, sampled ids and log-probs;
- :mod:`shopsimrl.training.trajectory`: those calls → one token-contiguous trajectory per episode,
  forked into sibling samples where a re-rendered prompt does not extend the tokens so far;
- :mod:`shopsimrl.training.samples`: the project's ``Sample`` record (slime's field contract) and
  its converter to slime's ``Sample``, which imports slime only when called;
- :mod:`shopsimrl.training.config`, :mod:`~shopsimrl.training.worker`,
  :mod:`~shopsimrl.training.store`: the training YAML, the rollout process and the run, a local
  directory or an object store location (v4 traces, the samples beside them, the lease journal);
- :mod:`shopsimrl.training.slime_adapter`, :mod:`~shopsimrl.training.grpo`: slime's
  custom-generate function, its dynamic-sampling filter and GRPO normaliser;
- :mod:`shopsimrl.training.triage`: the all-wrong triage of a group (one diagnostic rollout with
  every chunk, ``training/triage/group-*.json``);
- :mod:`shopsimrl.training.metrics`: the ``rollout/shopsim/*`` figures, through slime's
  all-samples and rollout-log hooks;
- :mod:`shopsimrl.training.curriculum`: the group-consistent skill curriculum (a content-addressed
  state built from a gate-selected bank; each group's skills drawn from slime's ``group_index``);
- :mod:`shopsimrl.training.task_data`, :mod:`~shopsimrl.training.preflight`: slime's prompt data
  for a split, and the offline check of a config with its inputs (``shopsimrl training check``).

Token ids, loss masks and log-probs never enter the evaluation trace: the trace of a training
episode is the same v4 record evaluation writes.
"""
