"""longpeft: parameter-efficient context extension for Hugging Face causal LMs."""

__version__ = "0.1.0"

from .spec import ContextSpec, SpecMismatchError  # noqa: E402


def load(*args, **kwargs):
    """Load a longpeft adapter onto a base model (spec first, then weights); see :func:`longpeft.loading.load`."""
    from .loading import load as _load

    return _load(*args, **kwargs)


__all__ = ["ContextSpec", "SpecMismatchError", "load", "__version__"]
