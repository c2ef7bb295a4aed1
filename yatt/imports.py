"""User code named by import path in a recipe (``algo.estimator``, ``reward.sources[i].path``)."""
from __future__ import annotations

import importlib
from collections.abc import Callable


def load_callable(path: str, key: str) -> Callable:
    """The callable at ``'package.module:function'``.

    Raises:
        ValueError: the module cannot be imported, has no such attribute, or it is not callable;
            the message starts with the config ``key`` and gives the import error.
    """
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{key}: cannot load {path!r} ({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is a {type(fn).__name__}, not callable")
    return fn
