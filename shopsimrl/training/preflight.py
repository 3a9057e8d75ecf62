"""``shopsimrl training check``: the training inputs, checked offline before slime starts.

Everything a rollout process would refuse on its first sample, and what it would silently get
wrong, is read here without starting a service: the config (unknown keys, strict types, the
positive integers ``run.concurrency``, ``runtime.max_steps``, ``filter.max_consecutive_unscored_groups``),
the split (not held out, its persona mode agreeing with ``environment.persona``), the system
prompt file, the skills file, the curriculum against the bank it was built from (digest, chunks
equal to the bank's enabled records, positive contributions, the state id), and slime's task data
(every task id of the split exactly once, in the schema of :mod:`shopsimrl.training.task_data`).
The first problem raises its error (exit 2 through the CLI's table) naming the key, file or line;
all clear gives :func:`check_training_inputs`'s report with ``status: ready``. Services (the shop,
the token endpoint) and slime's own flags are not checked (``scope: offline_inputs_only``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shopsimrl.prompts import PromptBuilder
from shopsimrl.schemas import redact_uri
from shopsimrl.skills import open_skill_provider
from shopsimrl.training.config import load_training_config, training_split
from shopsimrl.training.curriculum import open_curriculum
from shopsimrl.training.task_data import check_task_data

__all__ = ["NOT_CHECKED", "check_training_inputs"]

NOT_CHECKED = (
    "environment.base_url is reachable",
    "the token endpoint (model.base_url or slime's router) is reachable",
    "slime's own flags",
)


def check_training_inputs(config_path: str | Path, *, task_data: str | Path) -> dict[str, Any]:
    """The report of a config that is ready to train (module docstring); raises on the first problem."""
    config = load_training_config(config_path)
    split, persona = training_split(config)
    prompt_file = config.resolve(config.prompt.system_prompt_file) if config.prompt.system_prompt_file else None
    prompts = PromptBuilder.from_config(system_prompt=config.prompt.system_prompt, system_prompt_file=prompt_file)
    skills = (
        open_skill_provider(config.resolve(config.skills.path), max_skills=config.skills.max_skills).identity()
        if config.skills.path
        else None
    )
    curriculum = None
    if config.curriculum is not None:
        state = open_curriculum(config.resolve(config.curriculum.state), config.resolve(config.curriculum.skillbank))
        curriculum = {
            **state.identity(),
            "path": str(config.resolve(config.curriculum.state)),
            "chunks": [
                {"skill_id": c.skill_id, "contribution": c.contribution, "inclusion_probability": c.inclusion_probability}
                for c in state.chunks
            ],
        }
    data = check_task_data(task_data, split)
    return {
        "status": "ready",
        "scope": "offline_inputs_only",
        "config": str(Path(config_path).resolve()),
        "run_dir": config.run_location,
        "split": split.identity(),
        "persona": persona,
        "environment_url": redact_uri(config.environment.base_url),
        "run": {"seed": config.run.seed, "concurrency": config.run.concurrency},
        "runtime": {"max_steps": config.runtime.max_steps},
        "filter": config.filter.model_dump(),
        "prompt": {"system_prompt_file": str(prompt_file) if prompt_file else None, **prompts.identity()},
        "skills": skills,
        "curriculum": curriculum,
        "task_data": data.to_dict(),
        "not_checked": list(NOT_CHECKED),
    }
