"""Pluggable decisions: one abstract family per decision, one registered class per policy.

A family is an abstract subclass of `Policy` declared with `family=True`; it owns its own
registry, so two families may reuse a policy name ("default") without clashing:

    class RoutingPolicy(Policy, family=True):
        @abstractmethod
        def choose(self, ...) -> ...: ...

    @register("least_loaded")
    class LeastLoaded(RoutingPolicy): ...

    policy = create(RoutingPolicy, "least_loaded", **options_from_serve_config)

`register` returns the class it wraps unchanged (so it stays importable and testable on its
own). Registries are filled at import time and only read afterwards; a module that defines
policies must be imported before `create` can find them (each family's module imports its
own policies at its bottom, or the caller imports them).
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, cast

P = TypeVar("P", bound="Policy")


class Policy(ABC):
    """Base of every policy. `name` is the registered name, set by `register`."""

    name: ClassVar[str] = ""
    _registry: ClassVar[dict[str, type[Policy]]]

    def __init_subclass__(cls, family: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if family:
            cls._registry = {}

    @classmethod
    def family(cls) -> type[Policy]:
        """The family class (the nearest base declared with `family=True`)."""
        for klass in cls.__mro__:
            if "_registry" in vars(klass):
                return klass
        raise TypeError(
            f"{cls.__name__} belongs to no policy family (declare one with family=True)"
        )

    @classmethod
    def available(cls) -> list[str]:
        """Names registered in this class's family, sorted."""
        return sorted(cls.family()._registry)


def register(name: str) -> Callable[[type[P]], type[P]]:
    """Class decorator: register a concrete policy under `name` in its family."""

    def decorate(cls: type[P]) -> type[P]:
        registry = cls.family()._registry
        existing = registry.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(
                f"policy name {name!r} already taken in {cls.family().__name__} "
                f"by {existing.__qualname__}"
            )
        registry[name] = cls
        cls.name = name
        return cls

    return decorate


def _policy_class(family: Callable[..., Any]) -> type[Policy]:
    if not (isinstance(family, type) and issubclass(family, Policy)):
        raise TypeError(f"{family!r} is not a Policy class")
    return family


# `family` is typed as a callable so that abstract family classes type-check as arguments.
def lookup(family: Callable[..., P], name: str) -> type[P]:
    """The class registered as `name` in `family`; `ValueError` lists the known names."""
    base = _policy_class(family)
    cls = base.family()._registry.get(name)
    if cls is None or not issubclass(cls, base):
        known = ", ".join(base.available()) or "none"
        raise ValueError(f"unknown {base.__name__} {name!r} (known: {known})")
    return cast(type[P], cls)


def create(family: Callable[..., P], name: str, /, **options: Any) -> P:
    """Instantiate the policy registered as `name` in `family` with `options`."""
    return lookup(family, name)(**options)
