"""What ``shopsimrl evalset`` adds around running its members: the Helm route (``--helm-values``,
:mod:`shopsimrl.runner.evalset_helm`) and the set's trackers (one tracker run per member)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import typer

from shopsimrl.cli.common import track_summary, warn
from shopsimrl.cli.errors import BadInputError
from shopsimrl.config import ConfigError, TrackingSection
from shopsimrl.runner.evalset import EvalSet, Member

__all__ = ["print_helm_values", "set_tracking", "track_member"]


def print_helm_values(set_path: Path, out_dir: Path, shards: int) -> None:
    """Write one values file per member and print the ``helm install`` of each; exit 2 on bad input."""
    from shopsimrl.runner.evalset_helm import write_helm_values

    try:
        releases = write_helm_values(set_path, out_dir, shards)
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
    for release in releases:
        values = shlex.quote(str(out_dir / f"{release.member}.yaml"))
        typer.echo(f"helm install {release.release} helm/shopsimrl -f my-values.yaml -f {values}")
    typer.echo(f"{len(releases)} values files in {out_dir} (add your cluster's values as my-values.yaml)", err=True)


def set_tracking(the_set: EvalSet) -> TrackingSection | None:
    """The set's ``tracking:`` block checked (before anything runs); its ``dir`` relative to SET.yaml.
    None when it names no tracker."""
    from pydantic import ValidationError

    from shopsimrl.config import format_validation_error

    if not the_set.tracking:
        return None
    try:
        settings = TrackingSection.model_validate(the_set.tracking)
    except ValidationError as exc:
        raise BadInputError(format_validation_error(f"{the_set.path}: tracking", exc, {})) from None
    if not settings.backends:
        return None
    if settings.dir is not None:
        settings = settings.model_copy(update={"dir": str((the_set.path.parent / Path(settings.dir).expanduser()).resolve())})
    return settings


def track_member(settings: TrackingSection | None, the_set: EvalSet, member: Member, summary: dict[str, Any]) -> None:
    """Log one finished member as ``run --track`` logs a run, in a tracker run named by the member
    (``<tracking.name>-<member>`` when the block names one). Never raises: a tracker failure is a line."""
    if settings is None:
        return
    name = f"{settings.name}-{member.name}" if settings.name else member.name
    try:
        track_summary(str(the_set.run_dir(member)), summary, settings.model_copy(update={"name": name}))
    except Exception as exc:  # the tracker is optional; the set's results and exit code stand
        warn(f"member {member.name!r} not tracked: {type(exc).__name__}; the results are unaffected")
