"""HARPE: one RoPE base per attention head ("Breaking the Stage Barrier", Lian et al.).

Each key/value head rotates with its own RoPE base; with grouped-query attention the query heads
of a group use their KV head's base. Used as the initialisation of a LoRA (or full) run: the bases
are chosen when the adapter is created (``select_bases``), applied to the model
(``apply_head_bases``), recorded in the adapter's ContextSpec, and the model trains at the target
length in one stage. A merged model is exported for plain transformers with ``write_remote_code``.
"""

from .export import write_remote_code
from .patch import apply_head_bases, check_head_bases, has_head_bases, remove_head_bases
from .selection import peak_valley_bases, select_bases, uniform_bases

__all__ = [
    "apply_head_bases",
    "check_head_bases",
    "has_head_bases",
    "peak_valley_bases",
    "remove_head_bases",
    "select_bases",
    "uniform_bases",
    "write_remote_code",
]
