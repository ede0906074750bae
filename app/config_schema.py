"""Pydantic validation for the engine's plain dataclasses, derived from them field by field.

`engine/` stays free of pydantic: its configs are frozen stdlib dataclasses whose field
`metadata` holds validation bounds. `validated(cls)` is the annotation a settings model uses
for such a dataclass: pydantic validates the input against a model built from `cls`'s fields
(same names, types, defaults and bounds; nested dataclasses recursively; unknown keys are
errors naming the field) and hands back a `cls` instance. A field added to the dataclass is
therefore in the schema with no other edit.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, create_model
from pydantic_core import core_schema

_BOUNDS = frozenset({"ge", "gt", "le", "lt"})


def validated(cls: type) -> Any:
    """`Annotated[cls, ...]`: validates a mapping (or a `cls` instance) into a `cls`."""
    return Annotated[cls, _FromDataclass(cls)]


@functools.cache
def schema_model(cls: type) -> type[BaseModel]:
    """The pydantic model of dataclass `cls`: one field per dataclass field."""
    hints = typing.get_type_hints(cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
            annotation = validated(annotation)
        if f.default is not dataclasses.MISSING:
            default = Field(f.default, **_bounds(f))
        elif f.default_factory is not dataclasses.MISSING:
            default = Field(default_factory=f.default_factory, **_bounds(f))
        else:
            default = Field(..., **_bounds(f))
        fields[f.name] = (annotation, default)
    config = ConfigDict(extra="forbid", frozen=True)
    return create_model(cls.__name__, __config__=config, __doc__=cls.__doc__, **fields)


def _bounds(f: dataclasses.Field[Any]) -> dict[str, Any]:
    unknown = set(f.metadata) - _BOUNDS
    if unknown:
        raise TypeError(f"{f.name}: unknown validation metadata {sorted(unknown)}")
    return dict(f.metadata)


class _FromDataclass:
    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        model = schema_model(self.cls)
        cls = self.cls

        def to_dataclass(value: BaseModel) -> Any:
            return cls(**{name: getattr(value, name) for name in model.model_fields})

        def from_input(value: Any) -> Any:  # an instance passes as its fields
            if isinstance(value, cls):
                return {f.name: getattr(value, f.name) for f in dataclasses.fields(cls)}
            return value

        return core_schema.no_info_before_validator_function(
            from_input,
            core_schema.no_info_after_validator_function(
                to_dataclass, handler.generate_schema(model)
            ),
            serialization=core_schema.plain_serializer_function_ser_schema(
                functools.partial(_as_dict, cls)
            ),
        )


def _as_dict(cls: type, value: Any) -> Any:
    if isinstance(value, cls) and dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
