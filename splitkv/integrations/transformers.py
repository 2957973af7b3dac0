"""splitkv as an attention implementation of Hugging Face transformers (5.x).

    import splitkv.integrations.transformers as splitkv_hf

    splitkv_hf.register()   # once per process, before building a model or switching one
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, attn_implementation="splitkv")
    model.set_attn_implementation("splitkv")   # or on a model already built

Decode steps run `splitkv.decode` on the cache's K/V in place: 1 to 16 new tokens per sequence
after a prefill, an unpadded batch, a dynamic cache (full or sliding-window layers), bf16 or
fp16, head_dim 64/96/128/256, at most 16 query heads per K/V head. Every other call runs
transformers' sdpa attention, or the model's own eager attention where sdpa would drop part of
the layer (a logit soft-cap, attention sinks), so a model gives what it gives without splitkv.

How a call is proved to be such a decode step, with no host sync per layer:

- `register` also registers a mask function (transformers calls one per mask type and forward
  pass, not per layer). It returns transformers' sdpa mask unchanged, and marks the mask tensor
  when that mask is exactly splitkv's: transformers' own causal or sliding-window mask function
  (no overlay, no packed sequences, not a compiled static-cache step), the queries at the end of
  the cache (a dynamic cache: the query offset is a host int equal to the cache's length before
  the step), and no padding. The padding check reads the 2D ``attention_mask``: **one host sync
  per marked mask, so at most one per mask type and forward pass**, none without an
  ``attention_mask``; transformers' sdpa mask makes the same check itself for one-token steps of
  full-attention layers, and returns None when it passes. (A sliding layer that assisted
  generation rolled back holds its offsets in 0-dim device tensors, which transformers reads back
  when it sizes the mask; reading them here is a second sync for that mask.)
- The attention function takes a marked mask, or None at one query token (where sdpa attends to
  every key, as a decode step does), whose shape matches the layer's query and keys.

Compiled decode steps: `CompiledDecode` plans once for a StaticCache and hands each step's plan to
the attention function as keyword arguments of the model call, which reach it through the
model's own ``**kwargs``; the step then runs the ``splitkv::run`` custom op
(`splitkv.integrations.torch_ops`), which ``torch.compile(model, fullgraph=True)`` traces and its
CUDA-graph mode ("reduce-overhead") captures. See `CompiledDecode`.

Sliding windows: transformers' mask lets the query at position p see keys at positions
``p - W < k <= p`` for ``sliding_window = W`` (masking_utils.sliding_window_overlay; flash
attention's ``window_size=(W - 1, W - 1)`` says the same), which is splitkv's ``window_left = W -
1``. Positions are counted in the cache the layer returns, so a sliding layer that keeps only its
last W - 1 tokens gives the same steps as a full one.
"""

from __future__ import annotations

import functools
import logging
import sys

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    AttentionMaskInterface,
    and_masks,
    causal_mask_function,
    prepare_padding_mask,
    sdpa_mask,
    sliding_window_overlay,
)

import splitkv

logger = logging.getLogger(__name__)

#: What splitkv.decode takes; anything else falls back.
MAX_QUERY_TOKENS = 16
HEAD_DIMS = (64, 96, 128, 256)
MAX_GROUP = 16
_DTYPES = (torch.bfloat16, torch.float16)
_DEVICE_TYPES = ("cuda",)

#: The attribute the mask function sets on a mask splitkv computes itself: its window_left.
_MARK = "_splitkv_window_left"


def register(name: str = "splitkv") -> str:
    """Registers the attention function and its mask function under ``name`` (for
    ``attn_implementation=name``), and returns the name."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask)
    return name


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
         attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' sdpa mask, marked with its window_left where splitkv computes it exactly (see
    the module's docstring). Reads the 2D ``attention_mask`` back (a host sync) only for a mask it
    would otherwise mark."""
    made = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)
    # allow_is_causal_skip is False wherever transformers changed the pattern (or/and overlays, packed
    # sequences, block ids, bidirectional masks) or decodes a compiled static cache.
    if made is None or not allow_is_causal_skip:
        return made
    window = _window(mask_function, local_size)
    if window is None:
        return made  # another pattern
    # A sliding layer rolled back by assisted generation holds its offsets as 0-dim tensors, read here
    # (transformers' own get_mask_sizes has read them already); a static cache's differ (unless full).
    if int(q_offset) - int(kv_offset) != kv_length - q_length:
        return made  # the queries are not the last positions of the keys
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None and not bool(padding.all()):  # the host sync
        return made
    setattr(made, _MARK, window - 1 if window else -1)
    return made


# The code objects of transformers' sliding-window causal mask function: and_masks(overlay, causal).
_AND_CODE = and_masks(causal_mask_function).__code__
_OVERLAY_CODE = sliding_window_overlay(1).__code__


def _window(fn, local_size) -> int | None:
    """0 for transformers' causal mask function, W for its sliding-window one of ``local_size`` W,
    None for any other (chunked attention passes a local_size too)."""
    if local_size is None:
        return 0 if fn is causal_mask_function else None
    parts = _cell(fn, _AND_CODE, "mask_functions")
    if (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function
            and _cell(parts[0], _OVERLAY_CODE, "sliding_window") == local_size and local_size >= 1):
        return local_size
    return None


def _cell(fn, code, name):
    """The closure variable ``name`` of ``fn`` if ``fn`` is made from ``code``, else None."""
    if getattr(fn, "__code__", None) is not code:
        return None
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function: query ``[B, Hq, T, D]``, key and value ``[B, Hkv, L, D]`` (the cache
    after this step's update), returns ``([B, T, Hq, D], None)`` like transformers' sdpa.
    ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks) come as keywords, as transformers passes them;
    so do a `CompiledDecode` step's plan and handle."""
    plan = kwargs.pop(PLAN_KEYWORD, None)
    if plan is not None:
        return _planned_step(query, key, value, scaling, dropout, plan, kwargs), None
    window_left = _decode_window(query, key, attention_mask)
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    reason = None
    if window_left is not None:
        reason = _unsupported(query, key, value, dropout, softcap, sinks, kwargs)
        if reason is not None:
            _log_once(reason)
    if window_left is None or reason is not None:
        return _fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    q = query.transpose(1, 2)  # [B, T, Hq, D]: the projection's own layout, so usually no copy
    if not q.is_contiguous():
        q = q.contiguous()
    out = splitkv.decode(q, key, value, _lengths(key.shape[0], key.shape[2]), sm_scale=scaling, kv_layout="HND",
                         window_left=window_left, logits_soft_cap=0.0 if softcap is None else float(softcap),
                         sinks=None if sinks is None else _float32(sinks))
    return out, None


#: The keywords of a `CompiledDecode` step: the plan tensor, the DecodeAttention's handle and scale.
PLAN_KEYWORD, HANDLE_KEYWORD, SCALE_KEYWORD = "splitkv_plan", "splitkv_handle", "splitkv_scale"


class CompiledDecode:
    """Decode steps of a model over transformers' StaticCache, for ``torch.compile(model,
    fullgraph=True)`` and its CUDA-graph mode (``mode="reduce-overhead"``).

        steps = splitkv_hf.CompiledDecode(model, batch_size=B, max_cache_len=L)   # plans once
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        model(prompt, past_key_values=cache)                # the prefill: transformers' attention
        for p in range(P, P + n):                           # token p of every sequence
            logits = compiled(tokens, past_key_values=cache, position_ids=..., **steps.step(p + 1)).logits

    One plan of device lengths covers every length up to ``max_cache_len`` (`DecodeAttention.plan`
    with ``max_len``), so it is made once; `step` rewrites the lengths in place, outside the compiled
    region (a copy on the current stream, no host sync), and returns the keyword arguments that carry
    the plan into the attention function, which runs ``torch.ops.splitkv.run`` on the StaticCache's
    ``[B, Hkv, max_cache_len, D]`` tensors in place. The attention function must be splitkv's
    (`register`, then ``attn_implementation="splitkv"``); calls without these keywords, the prefill
    among them, run as they do without them.

    Every sequence of the batch holds its K/V from position 0 of its cache row (no left padding),
    and every layer attends to the whole cache: StaticCache's sliding layers keep a ring of the
    window's tokens, whose order splitkv does not read, so models with sliding layers, a logit
    soft-cap or attention sinks are refused here (their uncompiled steps run through `register`).
    """

    def __init__(self, model, batch_size: int, max_cache_len: int, query_tokens: int = 1):
        from . import torch_ops

        config = getattr(model.config, "get_text_config", lambda: model.config)()
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention"} or (not layer_types and getattr(config, "sliding_window", None)):
            raise ValueError("CompiledDecode: the model has sliding-window layers, whose StaticCache layers are rings "
                             "of the window's tokens; compiled steps take models whose layers all attend to the whole cache")
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("CompiledDecode: a logit soft-cap is not planned for compiled steps")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.dtype)
        if dtype is None:
            raise ValueError(f"CompiledDecode: the model is {model.dtype}; splitkv takes bf16 or fp16 models")
        self.query_tokens = int(query_tokens)
        # The scores' scale: the attention modules' own (each step checks that its layer's is the same).
        scale = next((float(m.scaling) for m in model.modules() if isinstance(getattr(m, "scaling", None), float)),
                     1.0 / head_dim ** 0.5)
        self.attention = splitkv.DecodeAttention(heads, kv_heads, head_dim, q_dtype=dtype, kv_dtype=dtype,
                                                 sm_scale=scale, kv_layout="HND")
        self.lengths = torch.full((batch_size,), self.query_tokens, dtype=torch.int32, device=model.device)
        self.attention.plan(self.lengths, max_len=max_cache_len, query_tokens=self.query_tokens)
        torch._dynamo.mark_static_address(self.lengths)  # CUDA graphs read it where it is, not a copy
        self._keywords = {PLAN_KEYWORD: torch_ops.plan_tensor(self.attention),
                          HANDLE_KEYWORD: torch_ops.handle(self.attention), SCALE_KEYWORD: scale}

    def step(self, lengths) -> dict:
        """Sets every sequence's length to ``lengths`` (an int, or one per sequence: the tokens in
        its cache after this step, its new ones included) and returns the model call's keywords."""
        if isinstance(lengths, int):
            self.lengths.fill_(lengths)
        else:  # a host sequence is staged through pinned memory, so the copy does not wait for the GPU
            self.lengths.copy_(torch.as_tensor(lengths, dtype=torch.int32).pin_memory(), non_blocking=True)
        return dict(self._keywords)


def _planned_step(query, key, value, scaling, dropout, plan, kwargs):
    """A `CompiledDecode` step: ``torch.ops.splitkv.run`` under the plan the keywords carry."""
    handle, planned_scale = kwargs.pop(HANDLE_KEYWORD), kwargs.pop(SCALE_KEYWORD)
    reason = _unsupported(query, key, value, dropout, None, None, kwargs)
    if reason is None and (kwargs.get("softcap") is not None or kwargs.get("s_aux", kwargs.get("sinks")) is not None):
        reason = "a logit soft-cap or attention sinks"
    if reason is None and scaling is not None and scaling != planned_scale:
        reason = f"a layer's scale {scaling} (planned with {planned_scale})"
    if reason is not None:
        raise ValueError(f"splitkv: a CompiledDecode step cannot take {reason}")
    return torch.ops.splitkv.run(query.transpose(1, 2).contiguous(), key, value, plan, handle)


def _decode_window(query, key, attention_mask) -> int | None:
    """window_left of a decode step that splitkv computes exactly, None for any other call."""
    tokens, length = query.shape[2], key.shape[2]
    if not 0 < tokens < length:
        return None  # a prefill: nothing in the cache before this step
    if attention_mask is None:
        # sdpa's own verdict for one query token: no padding, every key attended.
        return -1 if tokens == 1 else None
    window_left = getattr(attention_mask, _MARK, None)
    if window_left is None or tuple(attention_mask.shape[-2:]) != (tokens, length):
        return None
    return window_left


def _unsupported(query, key, value, dropout, softcap, sinks, kwargs) -> str | None:
    """Why splitkv.decode cannot take this step (a fixed sentence per cause), or None."""
    _, qo_heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    if query.device.type not in _DEVICE_TYPES:
        return f"{query.device.type} tensors"
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype} (splitkv takes bf16 or fp16)"
    if head_dim not in HEAD_DIMS or key.shape[-1] != head_dim or value.shape != key.shape:
        return f"head_dim {head_dim} (splitkv takes {', '.join(map(str, HEAD_DIMS))})"
    if qo_heads % kv_heads or qo_heads // kv_heads > MAX_GROUP:
        return f"{qo_heads} query heads on {kv_heads} K/V heads (at most {MAX_GROUP} per K/V head)"
    if tokens > MAX_QUERY_TOKENS:
        return f"more than {MAX_QUERY_TOKENS} new tokens per sequence"
    if not (_hnd(key) and _hnd(value)):
        return "K/V strides other than [B, Hkv, L, D] with rows of D contiguous"
    if dropout:
        return "attention dropout (training)"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    if softcap is not None and not softcap > 0:
        return f"softcap {softcap}"
    if sinks is not None and tuple(sinks.shape) != (qo_heads,):
        return f"sinks of shape {tuple(sinks.shape)}"
    return None


def _hnd(t) -> bool:
    """[B, Hkv, L, D], contiguous or a view cache[:, :, :L] of a longer one (rows of D contiguous)."""
    _, heads, length, head_dim = t.shape
    s = t.stride()
    return t.is_contiguous() or (s[3] == 1 and s[2] == head_dim and s[1] >= length * head_dim and s[0] == heads * s[1])


@functools.lru_cache(maxsize=64)
def _lengths(batch: int, length: int) -> np.ndarray:
    """Every sequence's length, L for all of an unpadded batch: host int32, made once per (B, L).
    On the host because decode() plans on every call, and device lengths would be read back."""
    return np.full(batch, length, dtype=np.int32)


_sinks32 = WeakIdKeyDictionary()


def _float32(sinks):
    """The sinks as the float32 [Hq] the kernel reads (gpt-oss keeps them in the model's dtype),
    converted once per parameter value rather than per layer call."""
    if sinks.dtype == torch.float32 and sinks.is_contiguous():
        return sinks.detach()
    if sinks.is_inference():  # no version counter to key on
        return sinks.detach().float().contiguous()
    held = _sinks32.get(sinks)
    if held is None or held[0] != sinks._version:
        held = (sinks._version, sinks.detach().float().contiguous())
        _sinks32[sinks] = held
    return held[1]


def _fallback(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, or the model's own eager attention where sdpa would ignore a
    soft-cap or sinks (sdpa_attention_forward takes neither)."""
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None and kwargs.get("sinks") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"splitkv: {type(module).__name__} has a soft-cap or sinks, which sdpa does not "
                                  f"compute, and its module defines no eager_attention_forward to fall back to")
    additive = _additive_mask(module, query, key, attention_mask, kwargs.get("is_causal"))
    return eager(module, query, key, value, additive, **kwargs)


def _additive_mask(module, query, key, attention_mask, is_causal):
    """An sdpa-style mask (boolean, or None for sdpa's own causal handling) as the additive float
    mask eager attention adds to its scores, as transformers' eager mask makes it."""
    tokens, length = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if tokens == 1 or not causal:
            return None
        # sdpa's is_causal is aligned to the top left: query i sees keys 0..i.
        attention_mask = torch.ones(tokens, length, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask.dtype != torch.bool:
        return attention_mask
    zero = torch.tensor(0.0, device=attention_mask.device, dtype=query.dtype)
    return torch.where(attention_mask, zero, torch.finfo(query.dtype).min)


_logged: set = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.debug("splitkv: %s; such calls run transformers' attention instead", reason)
