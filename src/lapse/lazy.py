"""Package namespaces whose names load with their submodule on first use (PEP 562).

A package's ``__init__`` that imported every submodule would bring torch in with the
lightest of them (a config): ``lapse --help`` took seconds. With :func:`exports` each name
is imported from its module when it is first asked for, and ``from lapse.models import
ModelConfig`` imports ``lapse.models.config`` alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import import_module
from types import ModuleType


def exports(
    package: str, modules: dict[str, tuple[str, ...]]
) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` of ``package``, which exports the names
    ``modules`` lists under each module (relative to ``package``, or absolute). Use as
    ``__all__, __getattr__, __dir__ = exports(__name__, {".config": ("ModelConfig",)})``."""
    where = {name: module for module, names in modules.items() for name in names}
    namespace = sys.modules[package].__dict__
    shadowed = {name for name, module in where.items() if module == f".{name}"}
    if shadowed:
        namespace["_shadowed_by_export"] = frozenset(shadowed)
        sys.modules[package].__class__ = _Package

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(where[name], package), name)
        namespace[name] = value  # the next lookup finds it without this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *where})

    return sorted(where), __getattr__, __dir__


class _Package(ModuleType):
    """A package that exports a name its submodule also has (``lapse.generation.generate``,
    the function of the module ``generate``): loading the module binds the module to that
    name in the package, wherever it is imported from, so the export is bound again over it,
    as an ``__init__`` that imports it after the module would leave it."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, ModuleType) and name in self.__dict__.get("_shadowed_by_export", ()):
            value = getattr(value, name)
        super().__setattr__(name, value)
