"""Names of a package loaded on first use (PEP 562), so that importing the package (the command line does,
for `flyspec --help`) does not import torch, scipy or the engine. Standard library only."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``homes`` (name -> the module
    that defines it) when it is first asked for."""

    def __getattr__(name: str) -> Any:
        if name in homes:
            return getattr(importlib.import_module(homes[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
