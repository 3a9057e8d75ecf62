"""``training …``: the files a slime training round reads, and their offline check.

``build-curriculum`` freezes a curriculum state from a gate-selected bank, ``prepare-data`` writes
slime's prompt data for a split, ``check`` reads a training config with its inputs as a rollout
process would, without starting anything. Each prints one JSON object on stdout; bad input exits
2 naming the file, key or line (the table of :mod:`shopsimrl.cli.errors`).

A new subcommand is one more ``@training_app.command`` here; module level imports typer and the
CLI's own modules only, the training modules load when a command runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from shopsimrl.cli.common import HELP_STYLE, QUIET, TRACK, VERBOSE, setup_logging, track_with, tracking_settings
from shopsimrl.cli.errors import BadInputError

app = typer.Typer(rich_markup_mode=None)
training_app = typer.Typer(
    help="Training rounds with slime: the skill curriculum, slime's task data, the offline preflight.", **HELP_STYLE
)
app.add_typer(training_app, name="training")


def _print(payload: dict[str, Any]) -> None:
    typer.echo(json.dumps(payload, indent=2, ensure_ascii=False))


@training_app.command("build-curriculum")
def build_curriculum(
    bank: Path = typer.Argument(
        ...,
        metavar="BANK",
        help="A gate-selected skill bank (selected_skillbank.json) or a snapshot of one "
        "(skills snapshot --selected): every enabled skill needs metadata.estimated_effect > 0.",
    ),
    out: Path = typer.Argument(
        ..., metavar="OUT", help="The state file to write; an existing file is never replaced by a different state."
    ),
    round_id: str = typer.Option(
        ..., "--round-id", help="The training round the state is for, e.g. round-001 (recorded and hashed)."
    ),
    seed: int = typer.Option(
        20260901, "--seed", help="Seed of every group's draws; with the state id it fixes which skills each group gets."
    ),
    skill_free_probability: float = typer.Option(
        ..., "--skill-free-probability", help="q: the share of groups that train without any skill, in [0, 1]."
    ),
    rho_min: float = typer.Option(
        ...,
        "--rho-min",
        help="rho of a chunk with the smallest effect: its inclusion probability in an assisted group, in [0, 1].",
    ),
    rho_max: float = typer.Option(..., "--rho-max", help="rho of a chunk whose effect reaches the scale, in [rho-min, 1]."),
    contribution_scale: float | None = typer.Option(
        None,
        "--contribution-scale",
        help="The effect that maps to rho-max (rho = rho-min + (rho-max − rho-min)·effect/scale, clipped); default: the largest effect.",
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Freeze a curriculum state: per-chunk inclusion probabilities from the gate's effects.

    The state id is the sha256 of the state's content (the bank's path is recorded, not hashed):
    the same bank and options give the same state and the same draws wherever the bank lies.
    Writing the same state again leaves the file as it is ("written": false)."""
    from shopsimrl.training.curriculum import build_curriculum_state, write_curriculum_state

    setup_logging(quiet, verbose)
    document = build_curriculum_state(
        bank,
        round_id=round_id,
        seed=seed,
        skill_free_probability=skill_free_probability,
        rho_min=rho_min,
        rho_max=rho_max,
        contribution_scale=contribution_scale,
    )
    state, written = write_curriculum_state(out, document)
    _print(
        {
            "path": str(out.resolve()),
            "written": written,
            **state.identity(),
            "chunks": [
                {"skill_id": c.skill_id, "contribution": c.contribution, "inclusion_probability": c.inclusion_probability}
                for c in state.chunks
            ],
        }
    )


@training_app.command("prepare-data")
def prepare_data(
    split_file: Path = typer.Argument(
        ..., metavar="SPLIT_FILE", help="The frozen split file, e.g. configs/splits/persona_splits.v1.json."
    ),
    split: str = typer.Argument(..., metavar="SPLIT", help="The split to train on (a held-out test split is refused)."),
    out: Path = typer.Argument(
        ..., metavar="OUT", help="The JSONL to write (replaced whole); slime reads it with --prompt-data OUT."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Write slime's prompt data: one line per task id of the split, in the split's order.

    Each line is {"prompt": "<task id>", "metadata": {"schema_version": "shopsimrl-slime-tasks-v1",
    "task_id", "split"}}; point slime at it with --prompt-data OUT --input-key prompt --metadata-key metadata."""
    from shopsimrl.training.task_data import write_task_data

    setup_logging(quiet, verbose)
    _print(write_task_data(split_file, split, out).to_dict())


@training_app.command("check")
def check(
    config: Path = typer.Argument(..., metavar="TRAINING.yaml", help="The training config slime's rollout process will use."),
    task_data: Path = typer.Option(
        ..., "--task-data", metavar="FILE", help="slime's prompt data (from prepare-data) that the run will train on."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Check a training config and its inputs offline: print a JSON report with status ready, or exit 2.

    Checks the config's keys and numbers, the split and persona, the system prompt file, the
    skills file, the curriculum against the bank it was built from (digest, chunks, contributions,
    state id) and that the task data holds every task id of the split exactly once. Services are
    not contacted."""
    from shopsimrl.training.preflight import check_training_inputs

    setup_logging(quiet, verbose)
    if not task_data.is_file():
        raise BadInputError(f"--task-data {task_data}: no such file")
    _print(check_training_inputs(config, task_data=task_data))


@training_app.command("step")
def step(
    config: str = typer.Argument(..., help="The training config (YAML) the adapter reads, as slime's shopsim_training_config."),
    task_data: str = typer.Option(
        ..., "--task-data", help="slime's prompt data (`shopsimrl training prepare-data`); one group per line."
    ),
    over_sampling_groups: int = typer.Option(
        16,
        "--over-sampling-batch-size",
        min=1,
        help="Groups generated (slime's --over-sampling-batch-size): the first lines of the task data.",
    ),
    batch_groups: int = typer.Option(
        12, "--rollout-batch-size", min=1, help="Groups the step hands to the trainer (slime's --rollout-batch-size)."
    ),
    samples_per_group: int = typer.Option(
        4, "--n-samples-per-prompt", min=1, help="Samples a group (slime's --n-samples-per-prompt)."
    ),
    temperature: float = typer.Option(0.6, "--rollout-temperature", help="Sampling temperature."),
    max_new_tokens: int = typer.Option(512, "--rollout-max-response-len", min=1, help="Token limit of one model call."),
    out: str = typer.Option(
        ..., "--out", help="Where the step's record goes (JSON: groups, filter answers, advantages, metrics)."
    ),
    track: list[str] | None = TRACK,
    track_step: int | None = typer.Option(
        None, "--track-step", min=0, help="With --track: the round's number, the x of the trackers' curves (default: the next)."
    ),
) -> None:
    """Play one slime-shaped GRPO rollout step through the training adapter, without slime.

    The stand-in of shopsimrl.training.slime_step (for make train-demo and tests, against any token
    endpoint and shop the config names): groups of samples through the custom-generate
    function, the dynamic-sampling filter, the all-samples hook, the GRPO normaliser and the
    rollout-log metrics, with the functions the docs tell slime to load. Nothing is trained."""
    from shopsimrl.training.slime_step import main

    tracking = tracking_settings(track)
    main(
        config,
        task_data=task_data,
        over_sampling_groups=over_sampling_groups,
        batch_groups=batch_groups,
        samples_per_group=samples_per_group,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        out=out,
    )
    if tracking is not None:
        record = json.loads(Path(out).read_text(encoding="utf-8"))
        track_with(tracking, lambda trackers: trackers.track_training_step(tracking, record, Path(out), step=track_step))
