"""What every persisted record shares: the model base, lenient scalar types, the version gate.

Records are read from files other programs wrote (the earlier implementation, older versions of
this one, hand edits), so a value of the wrong type inside an open payload is read as absent,
never coerced: ``"0.5"`` and ``true`` are not rewards. That leniency lives here, in the types,
and nowhere in the readers. A record's identity (its schema version, its episode id, its job)
is checked strictly.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, PlainValidator

__all__ = [
    "Count",
    "FlexBool",
    "FlexStr",
    "Number",
    "Object",
    "Objects",
    "OptObject",
    "Payload",
    "Record",
    "RecordVersionError",
    "check_version",
]


class RecordVersionError(ValueError):
    """A record of a schema version this shopsimrl does not read (newer, or of another kind)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _bool_or_none(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _object_or_empty(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _object_or_none(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _list_or_empty(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


# Plain validators: the value is checked by its type and kept as it is, never walked or copied
# (the environment's open payloads are most of a trace's bytes).
Number = Annotated[float | None, PlainValidator(_number, json_schema_input_type=float | None)]
"""A finite number, or None for anything else (bools, strings, NaN)."""
Count = Annotated[int | None, PlainValidator(_count, json_schema_input_type=int | None)]
"""A non-negative integer, or None for anything else."""
FlexStr = Annotated[str | None, PlainValidator(_text, json_schema_input_type=str | None)]
"""A string, or None for anything else."""
FlexBool = Annotated[bool | None, PlainValidator(_bool_or_none, json_schema_input_type=bool | None)]
"""A boolean, or None for anything else."""
Object = Annotated[dict[str, Any], PlainValidator(_object_or_empty, json_schema_input_type=dict[str, Any])]
"""An open JSON object kept as it came ({} for anything else)."""
OptObject = Annotated[dict[str, Any] | None, PlainValidator(_object_or_none, json_schema_input_type=dict[str, Any] | None)]
"""An open JSON object kept as it came, or None."""
Objects = Annotated[list[dict[str, Any]], PlainValidator(_list_or_empty, json_schema_input_type=list[dict[str, Any]])]
"""A list of open JSON objects kept as it came ([] for anything else)."""


def _required(schema: dict[str, Any], cls: Any) -> None:
    keys = getattr(cls, "ALWAYS_WRITTEN", ())
    if keys:
        schema["required"] = list(keys)
    documented = getattr(cls, "DOCUMENTED", None)
    if documented:
        schema["properties"] = {**documented, **schema.get("properties", {})}


class Record(BaseModel):
    """Base of every record shopsimrl writes and reads. A record keeps which keys it has: a key
    that was neither read nor set is not written (absent, not null), and unknown keys (additive
    keys of another writer, the environment's own payload keys) are kept and written after the
    known ones."""

    model_config = ConfigDict(
        extra="allow", validate_default=False, protected_namespaces=(), use_attribute_docstrings=True, json_schema_extra=_required
    )

    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = ()
    """Keys every record of this kind that shopsimrl writes has (``required`` in its JSON Schema);
    a reader still accepts records without them (the earlier implementation's fallback traces)."""


class Payload(Record):
    """An object another party defines (the environment's answers, a server's usage): every key is
    kept exactly as it came, in its order, and written back so; the properties of a subclass read
    the keys shopsimrl uses, a value of the wrong type as None. ``DOCUMENTED`` describes those keys
    in the JSON Schema."""

    DOCUMENTED: ClassVar[dict[str, dict[str, Any]]] = {}

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` as it came."""
        return (self.__pydantic_extra__ or {}).get(key, default)

    def as_dict(self) -> dict[str, Any]:
        """A copy of the payload as it came."""
        return dict(self.__pydantic_extra__ or {})

    def _number(self, key: str) -> float | None:
        return _number(self.get(key))

    def _count(self, key: str) -> int | None:
        return _count(self.get(key))

    def _text(self, key: str) -> str | None:
        return _text(self.get(key))

    def _flag(self, key: str) -> bool | None:
        return _bool_or_none(self.get(key))

    def _object(self, key: str) -> dict[str, Any] | None:
        return _object_or_none(self.get(key))


def check_version(value: Any, accepted: tuple[str, ...], *, kind: str, prefix: str) -> str:
    """The record's ``schema_version`` when this shopsimrl reads it; :class:`RecordVersionError`
    naming what was found and what is read otherwise (another version of the same kind says so)."""
    if value in accepted:
        return str(value)
    readable = ", ".join(accepted)
    if isinstance(value, str) and value.startswith(prefix):
        raise RecordVersionError(
            f"{kind} schema_version {value!r} is not one this shopsimrl reads ({readable}); "
            "it was written by another version: read it with that version or a newer shopsimrl"
        )
    raise RecordVersionError(f"not a {kind}: schema_version {value!r} (this shopsimrl reads {readable})")
