"""The policy registry: families, names, decorator transparency, lookup errors."""

from __future__ import annotations

from abc import abstractmethod

import pytest

from policies.base import Policy, create, lookup, register


class Greeting(Policy, family=True):
    @abstractmethod
    def greet(self) -> str: ...


class Farewell(Policy, family=True):
    @abstractmethod
    def leave(self) -> str: ...


class Hello(Greeting):
    def __init__(self, who: str = "world") -> None:
        self.who = who

    def greet(self) -> str:
        return f"hello {self.who}"


Registered = register("hello")(Hello)


@register("hello")  # the same name in another family does not clash
class Bye(Farewell):
    def leave(self) -> str:
        return "bye"


def test_register_returns_the_class_and_names_it():
    assert Registered is Hello
    assert Hello.name == "hello" and Bye.name == "hello"


def test_create_with_options_and_lookup_per_family():
    assert create(Greeting, "hello", who="firstlight").greet() == "hello firstlight"
    assert lookup(Farewell, "hello") is Bye
    assert Greeting.available() == ["hello"]


def test_unknown_names_and_duplicates_fail_clearly():
    with pytest.raises(ValueError, match=r"unknown Greeting 'nope' \(known: hello\)"):
        create(Greeting, "nope")

    class Other(Greeting):
        def greet(self) -> str:
            return "other"

    with pytest.raises(ValueError, match="already taken"):
        register("hello")(Other)
    assert register("hello")(Hello) is Hello  # re-registering the same class is harmless


def test_a_policy_outside_any_family_cannot_register():
    class Loose(Policy):
        pass

    with pytest.raises(TypeError, match="no policy family"):
        register("loose")(Loose)
