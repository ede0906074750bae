"""Settings schemas derived from the engine's plain dataclasses, field by field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from actors.settings import AppConfig
from app.config_schema import schema_model, validated
from engine.config import EngineConfig, SchedulerConfig


@dataclass(frozen=True, slots=True)
class Inner:
    size: int = field(default=4, metadata={"ge": 1})


@dataclass(frozen=True, slots=True)
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


class Holder(BaseModel):
    model_config = ConfigDict(extra="forbid")

    outer: validated(Outer) = Outer()  # type: ignore[valid-type]


def test_a_mapping_validates_into_the_dataclass_itself():
    holder = Holder(outer={"name": "y", "inner": {"size": 9}})
    assert holder.outer == Outer("y", Inner(9))
    assert type(holder.outer) is Outer and type(holder.outer.inner) is Inner
    assert Holder(outer=Outer("z")).outer == Outer("z")  # an instance passes as itself
    assert Holder().model_dump() == {"outer": {"name": "x", "inner": {"size": 4}}}


@pytest.mark.parametrize(
    ("outer", "loc"),
    [
        ({"inner": {"size": 0}}, "outer.inner.size"),  # the bound in the field's metadata
        ({"inner": {"sise": 2}}, "outer.inner.sise"),  # unknown keys are errors
        ({"nme": "y"}, "outer.nme"),
        ({"name": 3}, "outer.name"),
    ],
)
def test_bad_values_fail_naming_the_field(outer, loc):
    with pytest.raises(ValidationError) as info:
        Holder(outer=outer)
    assert loc in str(info.value)


def test_a_field_added_to_a_dataclass_is_in_the_schema_with_no_other_edit():
    bigger = dataclasses.make_dataclass(
        "BiggerScheduler",
        [("new_knob", int, field(default=3, metadata={"le": 5}))],
        bases=(SchedulerConfig,),
        frozen=True,
    )
    model = schema_model(bigger)
    assert "new_knob" in model.model_json_schema()["properties"]
    assert model(new_knob=5, max_num_seqs=2).new_knob == 5
    with pytest.raises(ValidationError, match="new_knob"):
        model(new_knob=6)


def test_the_app_schema_is_the_engine_config_field_by_field():
    schema = AppConfig.model_json_schema()
    defs = schema["$defs"]

    def names(cls: type) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    assert list(defs["EngineConfig"]["properties"]) == names(EngineConfig)
    assert list(defs["SchedulerConfig"]["properties"]) == names(SchedulerConfig)
    scheduler = defs["SchedulerConfig"]["properties"]
    assert scheduler["max_num_seqs"]["default"] == SchedulerConfig().max_num_seqs
    assert scheduler["max_num_seqs"]["minimum"] == 1  # from the field's metadata
    assert defs["SchedulerConfig"]["additionalProperties"] is False


def test_the_step_order_fields_validate_in_the_schema():
    def scheduler(**fields: object) -> SchedulerConfig:
        return AppConfig(engine={"scheduler": fields}).engine.scheduler

    assert scheduler() == SchedulerConfig()
    chosen = scheduler(policy="deadline", interactive_ttft_s=0.5, bulk_ttft_s=20)
    assert (chosen.policy, chosen.interactive_ttft_s, chosen.bulk_ttft_s) == ("deadline", 0.5, 20.0)
    assert scheduler(aging_s=None).aging_s is None  # strict priority
    assert scheduler(aging_s=float("inf")).aging_s == float("inf")  # YAML's .inf
    assert scheduler(aging_s="inf").aging_s == float("inf")  # an environment variable's
    assert scheduler(aging_s=12).aging_s == 12.0
    for bad in ({"aging_s": -1}, {"bulk_ttft_s": -0.5}, {"policy": 3}, {"aging_s": "soon"}):
        with pytest.raises(ValidationError, match=f"engine.scheduler.{next(iter(bad))}"):
            scheduler(**bad)


def test_unknown_metadata_is_refused():
    @dataclass
    class Typo:
        n: int = field(default=1, metadata={"minimum": 1})

    with pytest.raises(TypeError, match="minimum"):
        schema_model(Typo)
