"""Packages whose public names are imported from their submodules on first use (PEP 562 module `__getattr__`).

A toolkit package re-exports the public names of its submodules; importing all of them eagerly would load
matplotlib, scipy, datasets or the Trainer for a command that needs one small module of the package (the command
line's start-up and `--help` paid several seconds for it). `lazy_exports` gives the package a `__getattr__` that
imports the submodule holding a name when the name is first read, and a `__dir__` that lists the names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Mapping


def lazy_exports(
    package: str, exports: Mapping[str, Iterable[str]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`, whose public names are `exports`: {relative module: names}. A name
    may be written "attribute as alias" to export a module's attribute under another name. Any submodule of the
    package is also reachable as an attribute (as it was when the package imported them all). A name that is also
    the name of a submodule (`directional.decompose`, the function of `directional/decompose.py`) is imported at
    once: importing the submodule later would otherwise set the package's attribute to the module."""
    where: dict[str, tuple[str, str]] = {}
    for module, names in exports.items():
        for entry in names:
            attribute, _, alias = (part.strip() for part in entry.partition(" as "))
            where[alias or attribute] = (module, attribute)

    def __getattr__(name: str) -> object:
        if name in where:
            module, attribute = where[name]
            value = getattr(importlib.import_module(module, package), attribute)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # read once: later reads do not come back here
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    for name in where:
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            __getattr__(name)
    return __getattr__, __dir__
