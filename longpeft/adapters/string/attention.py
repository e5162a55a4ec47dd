"""STRING: shifted rotary positions at inference (An et al., 2024), switched on and off on a built model; the
causal LM classes of an exported model at the end (this file is ``modeling_string.py``'s).

Query ``i`` scores key ``j`` at distance ``d = i - j`` as RoPE does at ``d`` when ``d < S`` and at ``d - S + W`` when
``d >= S`` (paper Eq. 4; ``S``: the shift, ``W``: the local window). Only queries shift; the KV cache keeps its
positions. RoPE rotations compose, so a key rotated ``S - W`` steps forward scores as at ``d - S + W``: STRING is
exactly one softmax over ``[K ; K rotated by S - W]`` (``V`` duplicated), each key read once, plain or shifted.
Unlike the authors' prefill, the key at distance exactly ``S`` is scored once (shifted). Their ~1.07 factor on
cos/sin is ``cos_sin_scale`` (off by default): every attention logit times ``cos_sin_scale ** 2``.

Needs a DynamicCache (distances are cache-index differences: the queries are the last ``T`` of the ``L`` keys; left
padding keeps this true) and one RoPE base for all heads (not HARPE's)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

# longpeft-inline-begin
from ...family import attention_modules, causal_lm_of, define_export_classes, kernel_interface, pop_cache
from ...rope import apply_rotary, rotary_modules

# longpeft-inline-end

logger = logging.getLogger(__name__)

STRING_ATTENTION = "longpeft_string"
# Queries per block (SDPA, eager): the band read twice is this wide, about 3 * QUERY_BLOCK / seq_len extra work.
QUERY_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class StringSettings:
    """Active STRING settings (what :func:`string_settings` returns as a dict)."""

    shift: int
    local_window: int
    trained_length: int
    cos_sin_scale: float | None = None

    def __post_init__(self) -> None:
        if self.trained_length < 2:
            raise ValueError(f"STRING trained_length must be >= 2, got {self.trained_length}")
        if self.shift < 1:
            raise ValueError(f"STRING shift must be >= 1, got {self.shift}")
        if not 0 <= self.local_window <= self.shift:
            raise ValueError(
                f"STRING local_window must be between 0 and shift={self.shift}, got {self.local_window}; pass a "
                "smaller local_window (the paper uses W=128 with S=L/3 for L >= 2K) or a larger shift"
            )
        if self.cos_sin_scale is not None and not self.cos_sin_scale > 0:
            raise ValueError(f"STRING cos_sin_scale must be > 0 (or None to leave it off), got {self.cos_sin_scale}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for the attention module's repr, e.g. ``STRING(shift=341, local_window=128, ...)``."""
        fields = ", ".join(f"{name}={value}" for name, value in self.as_dict().items() if value is not None)
        return f"STRING({fields})"


class _StringConfigView:
    """An attention module's config while STRING is on: the model's (which the model keeps, so masks are built for
    the real implementation), but ``_attn_implementation`` is STRING's (the real one: ``base_attn_implementation``)."""

    def __init__(self, config: Any, settings: StringSettings, rotary_owner: nn.Module, rotary_name: str):
        vars(self).update(_base=config, string_settings=settings, _rotary_owner=rotary_owner, _rotary_name=rotary_name)

    @property
    def _attn_implementation(self) -> str:
        return STRING_ATTENTION

    @property
    def base_attn_implementation(self) -> str:
        return self._base._attn_implementation or "eager"

    def inv_freq(self) -> torch.Tensor:
        """The model's current rotary inverse frequencies, ``[head_dim // 2]``."""
        return getattr(self._rotary_owner, self._rotary_name).inv_freq

    def __getattr__(self, name: str) -> Any:
        if name == "_base":  # during unpickling/deepcopy, before __init__ ran
            raise AttributeError(name)
        return getattr(self._base, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._base, name, value)


# ---- switching STRING on and off


def install_string(model: nn.Module, settings: StringSettings) -> None:
    """Switch STRING on with ``settings``, in place, without checking the model (``enable_string`` checks): every
    attention module gets a config view, a hook refusing caches STRING cannot read distances from, and a repr."""
    rotaries = rotary_modules(causal_lm_of(model))
    if len(rotaries) != 1:
        raise ValueError(f"STRING expects exactly one rotary embedding module, found {len(rotaries)}")
    rotary_owner, rotary_name, _ = rotaries[0]
    attentions = attention_modules(model)
    if not attentions:
        raise ValueError(f"found no self-attention modules with q/k/v/o projections in {type(model).__name__}")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # heavy: not at import

    if STRING_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(STRING_ATTENTION, string_attention_forward)
    disable_string(model)
    for module in attentions:
        module.config = _StringConfigView(module.config, settings, rotary_owner, rotary_name)
        module._longpeft_string_hook = module.register_forward_pre_hook(_require_full_dynamic_cache, with_kwargs=True)
        module.extra_repr = settings.describe  # visible in print(model)


def _is_string_view(config: Any) -> bool:
    """Whether a config is a :class:`_StringConfigView`, longpeft's or an exported ``modeling_string.py``'s copy."""
    return "string_settings" in vars(config) and hasattr(config, "base_attn_implementation")


def disable_string(model: nn.Module) -> None:
    """Switch STRING off, in place; the model computes exactly what it did before enabling it."""
    for module in attention_modules(model):
        if _is_string_view(module.config):
            module.config = module.config._base
            module._longpeft_string_hook.remove()
            del module._longpeft_string_hook
            del module.extra_repr


def _require_full_dynamic_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """STRING reads distances off cache indices: the cache must hold every key in order (DynamicCache)."""
    cache = pop_cache(dict(kwargs))  # read only: the attention forward takes it as it is
    layers = getattr(cache, "layers", None)
    if not layers or module.layer_idx >= len(layers):
        return
    layer = layers[module.layer_idx]
    if not isinstance(layer, DynamicLayer) or isinstance(layer, DynamicSlidingWindowLayer):
        raise ValueError(
            f"STRING needs a DynamicCache that keeps every key (queries are the newest keys), got a "
            f"{type(layer).__name__}; use generate's default cache (no cache_implementation='static', no "
            "sliding-window cache) or disable STRING"
        )


def string_settings(model: nn.Module) -> dict[str, Any] | None:
    """The active STRING settings (keyword arguments for :func:`enable_string`), or None when off."""
    for module in attention_modules(model):
        if _is_string_view(module.config):
            return module.config.string_settings.as_dict()
    return None


# ---- the attention function registered as "longpeft_string"


def rotate_keys_forward(key: torch.Tensor, steps: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate RoPE'd keys ``[batch, kv_heads, keys, head_dim]`` by ``steps`` more positions (the key at ``j`` becomes
    the key at ``j + steps``) with the ``[head_dim // 2]`` rotary inverse frequencies ``inv_freq``."""
    angles = steps * inv_freq.to(device=key.device, dtype=torch.float64)
    angles = torch.cat((angles, angles))
    return apply_rotary(key, angles.cos().to(key.dtype), angles.sin().to(key.dtype))


def _plain_rows(shift: int, n_queries: int, n_keys: int) -> tuple[int, int]:
    """``(offset, n_plain)``: the cache index of query row 0 (the queries are the last ``n_queries`` of ``n_keys``),
    and how many leading query rows have no key ``shift`` or more positions away (plain attention)."""
    offset = n_keys - n_queries
    return offset, min(max(shift - offset, 0), n_queries)


def _far(first: int, end: int, keys_from: int, keys_to: int, shift: int, device: torch.device) -> torch.Tensor:
    """``[end - first, keys_to - keys_from]`` bool: the key at cache index ``keys_from + k`` is ``shift`` or more
    positions before the query row at ``first + q``: read shifted, not plain (``shift`` 0: the causal mask)."""
    rows = torch.arange(first, end, device=device)[:, None]
    return rows - torch.arange(keys_from, keys_to, device=device)[None, :] >= shift


def _unblock_empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """Let fully masked rows of a bool mask (padding queries, never read by real tokens) read every key: no NaN."""
    return mask | ~mask.any(dim=-1, keepdim=True) if mask.dtype == torch.bool else mask


def _block_mask(
    attention_mask: torch.Tensor | None, buffer: torch.Tensor | None, offset: int, first: int, end: int, shift: int
) -> torch.Tensor | None:
    """The mask of the query rows ``first .. end-1`` (cache indices) over the shifted copies of keys ``0 .. end-S-1``
    and the plain copies of keys ``first-S+1 .. end-1``: row ``i`` reads shifted key ``j`` when ``i - j >= S``, plain
    key ``j`` when ``0 <= i - j < S``. Without ``attention_mask``: None for one query, else additive, written into the
    flat ``buffer``; with it (``offset``: the cache index of its row 0), that mask restricted to those copies."""
    n_shifted, near_lo = end - shift, first - shift + 1
    if attention_mask is None and end - first == 1:
        return None
    if attention_mask is None:  # only three bands, each at most end - first columns wide, are blocked
        width = n_shifted + end - near_lo
        mask = buffer[: (end - first) * width].view(end - first, width).zero_()
        rows = torch.arange(first, end, device=mask.device)[:, None]

        def block_band(columns_from: int, keys: torch.Tensor, blocked: torch.Tensor) -> None:
            mask[:, columns_from : columns_from + keys.numel()].masked_fill_(blocked, float("-inf"))

        far_keys = torch.arange(near_lo, n_shifted, device=mask.device)  # shifted copies some rows must skip
        block_band(near_lo, far_keys, far_keys[None, :] > rows - shift)
        block_band(n_shifted, far_keys, far_keys[None, :] <= rows - shift)  # their plain copies, too far for others
        future_keys = torch.arange(first + 1, end, device=mask.device)  # causal part
        block_band(n_shifted + first + 1 - near_lo, future_keys, future_keys[None, :] > rows)
        return mask
    device = attention_mask.device
    allowed = torch.cat(
        (_far(first, end, 0, n_shifted, shift, device), ~_far(first, end, near_lo, end, shift, device)), dim=1
    )
    base = attention_mask[..., first - offset : end - offset, :]
    base = torch.cat((base[..., :n_shifted], base[..., near_lo:end]), dim=-1)
    if base.dtype == torch.bool:
        return _unblock_empty_rows(base & allowed)
    return base.masked_fill(~allowed, torch.finfo(base.dtype).min)


def string_attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    shift: int,
    local_window: int,
    inv_freq: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """STRING attention on torch's SDPA (exact): ``[batch, T, heads, head_dim]`` of ``query`` ``[batch, heads, T,
    head_dim]`` (RoPE'd at the T newest positions) over ``key``, ``value`` ``[batch, kv_heads, L, head_dim]``, with
    ``attention_mask`` None (causal) or ``[batch or 1, 1, T, L]``, bool (True: may attend) or additive, and
    ``inv_freq`` ``[head_dim // 2]``. Query blocks of ``block`` rows reuse one buffer of keys, values and mask."""
    batch, heads, n_queries, head_dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    offset, n_plain = _plain_rows(shift, n_queries, n_keys)
    out = query.new_empty(batch, n_queries, heads, head_dim)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, enable_gqa=True, **kw)

    if n_plain:  # over the keys up to the last plain row
        k_end = offset + n_plain
        if attention_mask is not None:
            mask = _unblock_empty_rows(attention_mask[..., :n_plain, :k_end])
        else:  # causal: None when the queries start at the first key
            mask = _far(offset, k_end, 0, k_end, 0, query.device) if offset else None
        plain = sdpa(
            query[:, :, :n_plain], key[:, :, :k_end], value[:, :, :k_end], attn_mask=mask, is_causal=mask is None
        )
        out[:, :n_plain] = plain.transpose(1, 2)
    if n_plain == n_queries:
        return out

    # Block keys: shifted copies of keys [0, n_shifted), then plain copies of keys [near_lo, end). n_shifted grows by
    # one block each step, so only the new shifted keys are rotated; the plain part after them is rewritten.
    rows_per_block = min(block, n_queries - n_plain)
    most_keys = (n_keys - shift) + rows_per_block + shift - 1
    keys = key.new_empty(batch, kv_heads, most_keys, head_dim)
    values = value.new_empty(batch, kv_heads, most_keys, head_dim)
    mask_buffer = query.new_empty(rows_per_block * most_keys) if attention_mask is None else None
    shifted_done = 0
    for start in range(n_plain, n_queries, block):
        stop = min(start + block, n_queries)
        first, end = offset + start, offset + stop  # cache indices of the block's queries: [first, end)
        n_shifted, near_lo = end - shift, first - shift + 1
        width = n_shifted + end - near_lo
        keys[:, :, shifted_done:n_shifted] = rotate_keys_forward(
            key[:, :, shifted_done:n_shifted], shift - local_window, inv_freq
        )
        values[:, :, shifted_done:n_shifted] = value[:, :, shifted_done:n_shifted]
        shifted_done = n_shifted
        keys[:, :, n_shifted:width] = key[:, :, near_lo:end]
        values[:, :, n_shifted:width] = value[:, :, near_lo:end]
        mask = _block_mask(attention_mask, mask_buffer, offset, first, end, shift)
        block_out = sdpa(query[:, :, start:stop], keys[:, :, :width], values[:, :, :width], attn_mask=mask)
        out[:, start:stop] = block_out.transpose(1, 2)
    return out


def string_attention_eager(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    shift: int,
    local_window: int,
    inv_freq: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    block: int = QUERY_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """STRING with explicit attention weights, ``(output [batch, T, heads, head_dim], weights [batch, heads, T, L])``
    (arguments as :func:`string_attention_sdpa`): the scores of keys at distance ``>= S`` shifted, one softmax."""
    n_queries, n_keys = query.shape[2], key.shape[2]
    offset, n_plain = _plain_rows(shift, n_queries, n_keys)
    groups = query.shape[1] // key.shape[1]
    key_rep, value_rep = (x.repeat_interleave(groups, dim=1) if groups > 1 else x for x in (key, value))
    scores = torch.matmul(query, key_rep.transpose(2, 3)) * scaling
    if n_plain < n_queries:
        shifted_key = rotate_keys_forward(key_rep[:, :, : n_keys - shift], shift - local_window, inv_freq)
        for start in range(n_plain, n_queries, block):
            stop = min(start + block, n_queries)
            n_shifted = offset + stop - shift
            shifted = torch.matmul(query[:, :, start:stop], shifted_key[:, :, :n_shifted].transpose(2, 3)) * scaling
            far = _far(offset + start, offset + stop, 0, n_shifted, shift, query.device)
            scores[:, :, start:stop, :n_shifted] = torch.where(far, shifted, scores[:, :, start:stop, :n_shifted])
    if attention_mask is None:
        attention_mask = _far(offset, n_keys, 0, n_keys, 0, query.device)
    if attention_mask.dtype == torch.bool:
        scores.masked_fill_(~attention_mask, torch.finfo(scores.dtype).min)
    else:
        scores += attention_mask  # in place: one [batch, heads, T, L] buffer fewer than eager attention
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=training)
    output = torch.matmul(weights, value_rep).transpose(1, 2).contiguous()
    return output, weights


def string_attention_flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shift: int,
    local_window: int,
    inv_freq: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    flash_fn: Callable[..., Any] | None = None,
) -> torch.Tensor:
    """STRING on unpadded batches (as :func:`string_attention_sdpa`): ``flash_fn`` (flash-attn's when None) over the
    distances ``0 .. S-1`` and over the shifted keys ``j <= i - S`` (bottom-right causal), merged by log-sum-exp."""
    if flash_fn is None:
        try:  # (in a try: transformers then does not require flash-attn to load an exported modeling file)
            from flash_attn import flash_attn_func as flash_fn
        except ImportError as error:
            raise ImportError(
                "STRING's flash path needs flash-attn; pip install flash-attn, or load the model with "
                "attn_implementation='sdpa'"
            ) from error
    n_queries, n_keys = query.shape[2], key.shape[2]
    _, n_plain = _plain_rows(shift, n_queries, n_keys)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # flash layout [batch, seq, heads, dim]
    options = {"dropout_p": dropout, "softmax_scale": scaling, "causal": True, "return_attn_probs": True}
    near_out, near_lse, _ = flash_fn(q, k, v, window_size=(shift - 1, 0), **options)
    if n_plain == n_queries:
        return near_out
    shifted_key = rotate_keys_forward(key[:, :, : n_keys - shift], shift - local_window, inv_freq).transpose(1, 2)
    far_out, far_lse, _ = flash_fn(
        q[:, n_plain:].contiguous(), shifted_key.contiguous(), v[:, : n_keys - shift].contiguous(), **options
    )
    near_lse_tail = near_lse[:, :, n_plain:]  # [batch, heads, rows]
    total = torch.logaddexp(near_lse_tail, far_lse)
    near_weight = torch.exp(near_lse_tail - total).transpose(1, 2).unsqueeze(-1)
    far_weight = torch.exp(far_lse - total).transpose(1, 2).unsqueeze(-1)
    merged = near_out[:, n_plain:].float() * near_weight + far_out.float() * far_weight
    return torch.cat((near_out[:, :n_plain], merged.to(near_out.dtype)), dim=1)


_WARNED: set[str] = set()  # "padded" once the padded-batch warning was given


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def string_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function for STRING (registered as ``"longpeft_string"``): dispatches on the model's
    real attention implementation, which runs unchanged when no key is ``S`` or more positions from any query."""
    view: _StringConfigView = module.config
    if getattr(view, "head_rope_bases", None):
        raise ValueError("per-head RoPE bases (HARPE) were set after STRING was enabled; STRING needs one base")
    settings = view.string_settings
    implementation = view.base_attn_implementation
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if settings.cos_sin_scale is not None:
        scaling = scaling * settings.cos_sin_scale**2
    if key.shape[2] - 1 < settings.shift:  # nothing is far enough to shift
        kwargs.update(dropout=dropout, scaling=scaling, sliding_window=sliding_window)
        return kernel_interface(module, implementation)(module, query, key, value, attention_mask, **kwargs)
    if sliding_window is not None and key.shape[2] > sliding_window:
        raise ValueError(
            f"STRING cannot run on a sliding-window attention layer (window {sliding_window}) with "
            f"{key.shape[2]} keys; disable the sliding window or STRING"
        )
    args = (settings.shift, settings.local_window, view.inv_freq(), scaling)
    if implementation == "eager":
        return string_attention_eager(
            query, key, value, attention_mask, *args, dropout=dropout, training=module.training
        )
    if implementation.startswith("flash_attention"):
        if attention_mask is None and query.device.type == "cuda" and _has_flash_attn():
            return string_attention_flash(query, key, value, *args, dropout=dropout), None  # else the SDPA path
        if attention_mask is not None:
            if "padded" not in _WARNED:
                _WARNED.add("padded")
                logger.warning(
                    "STRING on a flash-attention model: padded batches run on the exact SDPA path (the flash-attn "
                    "path takes unpadded batches only)"
                )
            # the [batch, L] padding mask (1 = token) as a [batch, 1, T, L] bool causal + padding mask
            n_keys = attention_mask.shape[-1]
            causal = _far(n_keys - query.shape[2], n_keys, 0, n_keys, 0, attention_mask.device)
            attention_mask = attention_mask.bool()[:, None, None, :] & causal
    elif implementation != "sdpa":
        raise ValueError(f"STRING supports eager, sdpa and flash_attention_2 attention, not {implementation!r}")
    return string_attention_sdpa(query, key, value, attention_mask, *args, dropout=dropout), None


# ---- the causal LM classes of an exported model (``StringLlamaForCausalLM``, ..., model_type ``string_llama``, ...)


class _StringCausalLM:
    """STRING at inference (``config.string``)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        settings = getattr(config, "string", None)
        if not settings:
            raise ValueError("config.json has no string settings: this is not a STRING model")
        install_string(self, StringSettings(**settings))


# Base model_type -> (exported model_type, config class name, causal-LM class name) for auto_map.
EXPORT_CLASSES_BY_MODEL_TYPE = define_export_classes(globals(), "string", _StringCausalLM)
