"""longpeft: parameter-efficient context extension for Hugging Face causal LMs."""

__version__ = "0.1.0"

from .spec import ContextSpec, SpecMismatchError  # noqa: E402

__all__ = ["ContextSpec", "SpecMismatchError", "__version__"]
