"""The peers, each called as its own documentation says an engine should: cuDNN and flash SDPA
through torch, FlashAttention-3 (the ``fa3-fwd`` wheel, ``fa3_fwd_interface``) and FlashInfer's
tensor-core paged decode. A peer that is not installed, or refuses a shape, raises `Unavailable`
with the reason; the benchmark reports it and goes on.

Every layout a peer prefers is built when its case is made, outside timing: SDPA gets q
[B, Hq, 1, D] and contiguous k/v [B, Hkv, L, D]; FA3 and FlashInfer read the layers' own
[B, L, Hkv, D] bytes (for FlashInfer as pages of 16 tokens, NHD; an FP8 cache's very bytes with its
scales). Plans and scheduler metadata are made once per shape, as an engine makes them once per
decode step, and serve every layer.
"""

from __future__ import annotations

import warnings

from .cases import Case, Unavailable, reason
from .inputs import Layers

#: FA3's FP8 path multiplies P, rounded to FP8 too, with V: its error on random data is several
#: times bf16's, and is not a wrong result.
FA3_FP8_TOLERANCE = 5e-2
PAGE_SIZE = 16
FLASHINFER_WORKSPACE_BYTES = 256 << 20


def sdpa_case(layers: Layers, backend: str) -> Case:
    """torch SDPA restricted to one backend; GQA through enable_gqa, else K/V repeated to Hq heads."""
    torch = layers.torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = layers.shape
    _no_batch_invariance(layers)
    if s.quantized:
        raise Unavailable(f"SDPA reads bf16/fp16 K/V, not {s.kv_dtype}")
    if s.has_variant:
        raise Unavailable("SDPA's decode backends take no window, soft-cap, sinks or several query tokens "
                          "(without an explicit mask, which no backend here decodes with)")
    which = getattr(SDPBackend, backend)

    def context():
        return sdpa_kernel(which)

    qs = [q.view(s.batch, s.num_qo_heads, 1, s.head_dim) for q in layers.q]
    # SDPA's native layout, made contiguous outside timing so that no hidden copy is timed; shared
    # by both backends.
    ks, vs = layers.memo("sdpa-kv", lambda: ([k.transpose(1, 2).contiguous() for k in layers.k],
                                             [v.transpose(1, 2).contiguous() for v in layers.v]))

    def attempt(k_, v_, **kw):
        with warnings.catch_warnings(record=True) as caught, context():
            warnings.simplefilter("always")
            try:
                F.scaled_dot_product_attention(qs[0], k_, v_, **kw)
                torch.cuda.current_stream().synchronize()
                return None
            except Exception as exc:  # noqa: BLE001 - a refused backend must not end the run
                return reason(exc, caught)

    info, kw = {}, {}
    if s.group_size == 1:
        err = attempt(ks[0], vs[0])
        if err:
            raise Unavailable(err)
        info["gqa"] = "mha"
    else:
        err = attempt(ks[0], vs[0], enable_gqa=True)
        if err is None:
            info["gqa"], kw = "enable_gqa", {"enable_gqa": True}
        else:
            ks, vs = layers.memo("sdpa-kv-repeated", lambda: (
                [k.repeat_interleave(s.group_size, dim=1) for k in ks],
                [v.repeat_interleave(s.group_size, dim=1) for v in vs]))
            err2 = attempt(ks[0], vs[0])
            if err2:
                raise Unavailable(f"enable_gqa: {err}; repeated K/V: {err2}")
            info.update(gqa="repeat kv", gqa_refused=err)

    outs = [None] * layers.count

    def launcher(i):
        q, k, v = qs[i], ks[i], vs[i]

        def call():
            outs[i] = F.scaled_dot_product_attention(q, k, v, **kw)
        return call

    def outputs():
        return [o.reshape(s.batch, s.num_qo_heads, s.head_dim) for o in outs]

    return Case([launcher(i) for i in range(layers.count)], outputs, context=context, info=info, keep=(ks, vs))


def _no_batch_invariance(layers: Layers) -> None:
    if layers.shape.deterministic:
        raise Unavailable("no batch-invariant decode mode")


def _peer_module(module: str, package: str, layers: Layers, no_format: str):
    """A peer's module, imported; Unavailable when it is not installed or reads neither bf16 nor
    FP8 K/V of the shape (``no_format`` says why)."""
    import importlib

    try:
        found = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001
        raise Unavailable(f"{package} not installed ({reason(exc)})") from None
    if layers.shape.kv_dtype not in ("bf16", "fp8_e4m3"):
        raise Unavailable(no_format)
    return found


def fa3_case(layers: Layers) -> Case:
    """FlashAttention-3's ``flash_attn_with_kvcache`` over the contiguous cache, with scheduler
    metadata made once. Its FP8 path takes q, K and V all in float8_e4m3fn with descale factors:
    the query is quantized per tensor here, and checked against the reference over that query."""
    torch = layers.torch
    fa3 = _peer_module("fa3_fwd_interface", "fa3-fwd", layers, f"FA3 has no {layers.shape.kv_dtype} K/V")
    s = layers.shape
    _no_batch_invariance(layers)
    if s.sinks:
        raise Unavailable("FA3 (fa3-fwd 0.0.3) takes no attention sinks")
    fp8 = s.kv_dtype == "fp8_e4m3"
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    seqlens = torch.full((s.batch,), s.seq_len, dtype=torch.int32, device="cuda")
    # Several query tokens are causal among themselves, bottom-right aligned as FA3 aligns a cache's.
    variant = dict(causal=s.query_tokens > 1, window_size=(s.window_left, 0) if s.window_left >= 0 else (-1, -1))
    metadata = fa3.get_scheduler_metadata(s.batch, s.query_tokens, s.seq_len, s.num_qo_heads, s.num_kv_heads,
                                          s.head_dim, seqlens, qkv_dtype=dtype, has_softcap=s.soft_cap > 0, **variant)
    variant["softcap"] = s.soft_cap
    shape4 = (s.batch, s.query_tokens, s.num_qo_heads, s.head_dim)
    args, queries, reference, tolerance = [], None, None, None
    if fp8:
        def descale(scale):
            return scale.float().reshape(1, -1).expand(s.batch, s.num_kv_heads).contiguous()

        queries = []
        for q, k, v in zip(layers.q, layers.k, layers.v):
            q_scale = (q.float().abs().amax() / 448.0).clamp_min(1e-12)
            q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
            queries.append(q8.float() * q_scale)
            args.append((q8.view(shape4), k.values.view(torch.float8_e4m3fn), v.values.view(torch.float8_e4m3fn),
                         dict(q_descale=descale(q_scale), k_descale=descale(k.scale), v_descale=descale(v.scale))))
        reference = layers.reference(queries, key="fa3-fp8-query")
        tolerance = FA3_FP8_TOLERANCE
    else:
        args = [(q.view(shape4), k, v, {}) for q, k, v in zip(layers.q, layers.k, layers.v)]
    outs = [None] * layers.count

    def launcher(i):
        q, k, v, kw = args[i]

        def call():
            outs[i] = fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, scheduler_metadata=metadata,
                                                  **variant, **kw)
        return call

    def outputs():
        return [o.reshape(layers.q[0].shape) for o in outs]

    case = Case([launcher(i) for i in range(layers.count)], outputs, reference=reference,
                info={"qkv_dtype": str(dtype).replace("torch.", "")}, keep=(args, seqlens, metadata))
    if tolerance is not None:
        case.tolerance = tolerance
    return case


def flashinfer_case(layers: Layers) -> Case:
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores, in its CUDA-graph mode
    (fixed index buffers), planned once; each layer's cache as pages of 16 tokens (NHD views of the
    same bytes when L is a multiple of 16). FP8 caches go in as their bytes with per-tensor scales;
    FlashInfer has no NVFP4 decode on Hopper."""
    torch = layers.torch
    flashinfer = _peer_module("flashinfer", "flashinfer", layers,
                              f"FlashInfer has no {layers.shape.kv_dtype} K/V decode for this GPU")
    s = layers.shape
    _no_batch_invariance(layers)
    if s.sinks:
        # run(sinks=...) is accepted and dropped on Hopper: the fa2/fa3 prefill kernels that the
        # tensor-core decode runs on take no sinks (only trtllm-gen, sm_100+, and the JIT
        # AttentionSink variant do), and the output check cannot tell at long L, where the sink's
        # weight is below its bound.
        raise Unavailable("FlashInfer 0.6.18's decode wrapper ignores sinks on this GPU (fa2/fa3 backends); "
                          "its JIT AttentionSink variant is not timed here")
    if s.query_tokens > 1:
        raise Unavailable("FlashInfer's decode wrapper serves one query token per sequence (several go through "
                          "its prefill wrappers, not timed here)")
    pages_per_seq = -(-s.seq_len // PAGE_SIZE)
    pool = (s.batch * pages_per_seq, PAGE_SIZE, s.num_kv_heads, s.head_dim)

    def paged(x):
        if s.seq_len % PAGE_SIZE == 0:
            return x.view(pool)  # [B, L, Hkv, D] contiguous already is a page pool: the same bytes
        padded = torch.zeros((s.batch, pages_per_seq * PAGE_SIZE, s.num_kv_heads, s.head_dim), dtype=x.dtype,
                             device="cuda")
        padded[:, : s.seq_len].copy_(x)
        return padded.view(pool)

    caches, scales = [], []
    for k, v in zip(layers.k, layers.v):
        if s.quantized:
            caches.append((paged(k.values.view(torch.float8_e4m3fn)), paged(v.values.view(torch.float8_e4m3fn))))
            scales.append({"k_scale": float(k.scale[0]), "v_scale": float(v.scale[0])})
        else:
            caches.append((paged(k), paged(v)))
            scales.append({})
    dev = "cuda"
    indptr = torch.arange(s.batch + 1, dtype=torch.int32, device=dev) * pages_per_seq
    indices = torch.arange(s.batch * pages_per_seq, dtype=torch.int32, device=dev)
    last_page_len = torch.full((s.batch,), s.seq_len - (pages_per_seq - 1) * PAGE_SIZE, dtype=torch.int32,
                               device=dev)
    buffers = (torch.empty_like(indptr), torch.empty_like(indices), torch.empty_like(last_page_len))
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=buffers[0],
        paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2])
    variant = {}
    if s.window_left >= 0:
        variant["window_left"] = s.window_left
    if s.soft_cap > 0:
        variant["logits_soft_cap"] = s.soft_cap
    wrapper.plan(indptr, indices, last_page_len, s.num_qo_heads, s.num_kv_heads, s.head_dim, PAGE_SIZE,
                 q_data_type=torch.bfloat16, kv_data_type=caches[0][0].dtype, **variant)
    outs = [torch.empty_like(q) for q in layers.q]

    def launcher(i):
        q, cache, out, kw = layers.q[i], caches[i], outs[i], scales[i]

        def call():
            wrapper.run(q, cache, out=out, **kw)
        return call

    info = {"page_size": PAGE_SIZE, "kv_layout": "NHD", "use_tensor_cores": True}
    return Case([launcher(i) for i in range(layers.count)], lambda: outs, info=info,
                keep=(workspace, indptr, indices, last_page_len, buffers, wrapper, caches))


#: The peers by name, in column order.
PEER_SETUPS = {
    "sdpa-cudnn": lambda layers: sdpa_case(layers, "CUDNN_ATTENTION"),
    "sdpa-flash": lambda layers: sdpa_case(layers, "FLASH_ATTENTION"),
    "fa3": fa3_case,
    "flashinfer-tc": flashinfer_case,
}
PEER_NAMES = {"sdpa-cudnn": "cuDNN SDPA", "sdpa-flash": "SDPA-flash", "fa3": "FA3", "flashinfer-tc": "FlashInfer tc"}
#: --peers groups
PEER_GROUPS = {"sdpa": ("sdpa-cudnn", "sdpa-flash"), "flashinfer": ("flashinfer-tc",)}


def parse_peers(text: str) -> list[str]:
    """'all', 'none', or a comma list of peer names and groups (sdpa, flashinfer)."""
    text = str(text).strip().lower()
    if text in ("all", ""):
        return list(PEER_SETUPS)
    if text == "none":
        return []
    chosen = []
    for name in text.split(","):
        name = name.strip()
        if not name:
            continue
        for n in PEER_GROUPS.get(name, (name,)):
            if n not in PEER_SETUPS:
                raise ValueError(f"peers: unknown peer {name!r} (known: {sorted(PEER_SETUPS)} "
                                 f"and groups {sorted(PEER_GROUPS)})")
            if n not in chosen:
                chosen.append(n)
    return chosen
