"""Optional dependencies: which of meshpipe's extras brings each, and errors that say so. Pure.

meshpipe's core install (`pip install meshpipe`) trains the built-in models on synthetic
data. The rest comes in extras (pyproject's `[project.optional-dependencies]`):

    extra        brings                                 needed for
    models       flax, equinox                          the flax.nnx / flax.linen / equinox adapters
    data         datasets, tokenizers, grain            data.source text/tokens/hf/grain, `meshpipe prepare`
    checkpoint   orbax-checkpoint                       `checkpoint:`, `--resume`, `meshpipe export`

Where meshpipe imports one of them it goes through `require` (the adapters, checkpointing),
and where it imports the user's code (a model or data factory, whose module may import flax
at its top) through `hinting`: a `ModuleNotFoundError` for a package of an extra becomes a
`MissingExtra` — still a ModuleNotFoundError with the same `name` — whose message ends with
the command that installs it, e.g. ``No module named 'flax' (flax comes with meshpipe's
'models' extra: pip install 'meshpipe[models]')``. A missing module that belongs to no extra
is re-raised unchanged.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator, Optional

__all__ = ["EXTRAS", "MissingExtra", "extra_of", "install_hint", "require", "hinting", "with_hint"]

# top-level import name -> the extra that installs it
EXTRAS = {"flax": "models", "equinox": "models", "orbax": "checkpoint",
          "datasets": "data", "tokenizers": "data", "grain": "data"}


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def extra_of(module: Optional[str]) -> Optional[str]:
    """The extra that installs `module` (a dotted import name), or None.

    >>> extra_of("flax.nnx"), extra_of("orbax.checkpoint"), extra_of("numpy")
    ('models', 'checkpoint', None)
    """
    return EXTRAS.get((module or "").split(".")[0])


def install_hint(module: str) -> str:
    """How to install the extra that brings `module`.

    >>> install_hint("equinox")
    "equinox comes with meshpipe's 'models' extra: pip install 'meshpipe[models]'"
    """
    top, extra = module.split(".")[0], extra_of(module)
    return f"{top} comes with meshpipe's {extra!r} extra: pip install 'meshpipe[{extra}]'"


def with_hint(e: BaseException) -> BaseException:
    """`e` as a MissingExtra naming the extra when it is a ModuleNotFoundError for a package of
    one (and does not say so yet); else `e` itself."""
    if not isinstance(e, ModuleNotFoundError) or isinstance(e, MissingExtra) or extra_of(e.name) is None:
        return e
    return MissingExtra(f"{e} ({install_hint(e.name)})", name=e.name, path=e.path)


@contextlib.contextmanager
def hinting() -> Iterator[None]:
    """Around an import of the user's code: a missing optional package raises MissingExtra.

    >>> with hinting():
    ...     import equinox_not_a_real_package   # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ModuleNotFoundError: No module named 'equinox_not_a_real_package'
    """
    try:
        yield
    except ModuleNotFoundError as e:
        hinted = with_hint(e)
        if hinted is e:
            raise
        raise hinted from e


def require(module: str, what: str):
    """Import `module` for `what` (e.g. "nnx_model"); MissingExtra naming the extra if it is absent."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if extra_of(e.name) is None:
            raise
        raise MissingExtra(f"{what} needs {e.name.split('.')[0]}, which is not installed; {install_hint(e.name)}",
                           name=e.name) from e
