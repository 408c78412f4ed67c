"""Finds the compiled kernels (``atom._C``) and decides whether ops use them.

``atom._C`` exists only where setup.py found a GPU torch and a GPU compiler.
Every op keeps a torch reference; ``ATOM_FORCE_REFERENCE=1`` makes all ops
use it even where the kernels exist (to bisect a kernel bug).
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch


@functools.cache
def get_C() -> ModuleType | None:  # noqa: N802 - named after the module it returns
    """The ``atom._C`` module, or None where it was not built or cannot load."""
    try:
        return importlib.import_module("atom._C")
    except ModuleNotFoundError as e:
        if e.name != "atom._C":
            raise
        return None
    except ImportError as e:  # built, but broken here (driver missing, ABI mismatch)
        warnings.warn(f"atom._C exists but failed to load ({e}); using torch references", stacklevel=2)
        return None


def use_kernels() -> bool:
    """True when ops on GPU tensors should call ``atom._C`` kernels."""
    if os.environ.get("ATOM_FORCE_REFERENCE") == "1":
        return False
    if torch.version.cuda is None and torch.version.hip is None:
        return False
    return get_C() is not None
