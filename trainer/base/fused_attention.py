"""Fused core attention for Megatron-core without TransformerEngine, and the layer spec.

Megatron-core's local layer spec uses ``DotProductAttention``, which materializes the
[b, heads, s, s] score matrix (FINDINGS.md: 640 ms and 99 GiB for a 1.7B model at
16 x 1024 tokens on an H200, vs 439 ms / 69 GiB for Hugging Face with SDPA). Here the
same computation runs through PyTorch's fused kernels:

- unpacked batches ([s, b, h] with a causal mask or an explicit mask): ``F.scaled_dot_product_attention``;
- packed streams (``trainer.base.packing``, Megatron's ``thd``): attention confined to each
  sequence, through ``torch.nn.attention.varlen.varlen_attn`` (flash varlen) where it
  runs, ``flex_attention`` with a document block mask, or causal SDPA per document
  (backend name ``dense``: CPU, and the reference the others are tested against).
  varlen and the per-document loop keep documents fully apart, non-finite values
  included; flex computes blocks that straddle two documents with zero weights, so a
  NaN/inf in one document can reach its neighbours (0 * NaN), which breaks the
  trainer's per-slot fault isolation: it is only the fallback where varlen is missing.

``PackedSelfAttention`` is Megatron's ``SelfAttention`` with one change for packed
streams: RoPE is applied to the whole stream at once with per-token positions
(Megatron's non-TE ``thd`` RoPE loops over the sequences in Python, in every layer).

Where ``transformer_engine`` imports, ``lorafleet_gpt_layer_spec`` returns TE's spec
unchanged: TE's fused attention handles both layouts itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from typing import Literal

import torch
import torch.nn.functional as F

from trainer.platform.cpu_compat import apply_cpu_compat, transformer_engine_available

apply_cpu_compat()  # before megatron-core's attention module is imported (flash_mla, see there)

from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer.attention import SelfAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402
from megatron.core.utils import divide  # noqa: E402

from trainer.base.packing import DocumentLayout  # noqa: E402

PackedBackend = Literal["auto", "varlen", "flex", "dense"]
RecomputeMode = Literal["none", "full", "selective"]

# qkv_format of the view PackedSelfAttention hands to the core attention: q, k, v
# are [T, 1, heads, dim] (the stream as one sbhd sequence) and attention must stay
# inside the documents described by ``layout``.
DOCUMENTS_FORMAT = "sbhd_documents"


@dataclasses.dataclass
class DocumentsView:
    """What ``PackedSelfAttention`` passes as ``packed_seq_params`` to the core attention."""

    layout: DocumentLayout
    qkv_format: str = DOCUMENTS_FORMAT


def layout_of(params: PackedSeqParams | DocumentsView) -> DocumentLayout:
    """The document layout of packed params: the precomputed one, else derived (one sync)."""
    layout = getattr(params, "layout", None)
    if layout is not None:
        return layout
    if params.cu_seqlens_q_padded is not None or (
        params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q
        and not torch.equal(params.cu_seqlens_kv, params.cu_seqlens_q)
    ):
        raise NotImplementedError(
            "packed self-attention needs identical unpadded q/kv cu_seqlens; "
            "padded cu_seqlens (cu_seqlens_*_padded) are not supported without TransformerEngine"
        )
    return DocumentLayout.from_cu_seqlens(params.cu_seqlens_q, params.max_seqlen_q)


# ---------------------------------------------------------------------------------------
# Packed (document-masked) attention kernels. q, k, v: [T, heads, dim]; returns [T, hq, dim].
# ---------------------------------------------------------------------------------------


def _repeat_kv(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def packed_attention_dense(q, k, v, layout: DocumentLayout, scale: float, dropout_p: float = 0.0):
    """Reference: causal SDPA over each document on its own (a loop over the documents).

    Exact isolation between documents, also for non-finite values: one SDPA over the
    whole stream with a same-document mask would multiply another document's NaN/inf
    values by zero weights (0 * NaN = NaN) and leak them across, forward and backward.
    The trainer relies on that isolation (a diverged slot skips only its own step).
    """
    groups = q.shape[1] // k.shape[1]
    outs = []
    start = 0
    for n in layout.lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(
            q[sl].transpose(0, 1).unsqueeze(0),
            _repeat_kv(k[sl], groups, 1).transpose(0, 1).unsqueeze(0),
            _repeat_kv(v[sl], groups, 1).transpose(0, 1).unsqueeze(0),
            is_causal=n > 1,
            dropout_p=dropout_p,
            scale=scale,
        )[0].transpose(0, 1))
        start += n
    return torch.cat(outs, dim=0)


@functools.lru_cache(maxsize=1)
def _varlen_fn():
    """(varlen_attn, its keyword names) or None where this torch has no varlen attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_available(device: torch.device) -> bool:
    return device.type == "cuda" and _varlen_fn() is not None


def packed_attention_varlen(q, k, v, layout: DocumentLayout, scale: float):
    """Flash-attention varlen: one kernel over all documents, no mask tensor at all."""
    fn, params = _varlen_fn()
    kwargs = {}
    # The signature moved between torch releases: early ones take is_causal; 2.11
    # (the GPU machine) takes window_size=(-1, 0) for causal and scale, but has no
    # enable_gqa (GQA then goes to aten's kernels directly: FlashVarlenCausal); 2.14
    # adds enable_gqa.
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # the aten kernels take GQA natively: no repeated k/v copies
            return FlashVarlenCausal.apply(q, k, v, layout.cu_seqlens, layout.max_seqlen, scale)
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]), rel_tol=1e-12):
        q = q * (scale * math.sqrt(q.shape[-1]))
    cu = layout.cu_seqlens
    return fn(q, k, v, cu, cu, layout.max_seqlen, layout.max_seqlen, **kwargs)


class FlashVarlenCausal(torch.autograd.Function):
    """Causal flash-attention over packed documents through aten's varlen kernels directly.

    Those kernels (FlashAttention-2) take k/v with fewer heads than q (GQA, each kv head
    shared by q.heads / kv.heads query heads); torch 2.11's ``varlen_attn`` wrapper has no
    way to pass that, so k/v would be repeated: two extra [T, heads, dim] copies forward and
    a reduction backward per layer. q [T, hq, d], k/v [T, hkv, d], ``cu`` int32 [docs + 1]."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):  # noqa: ANN001 - autograd signature
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_state, unused,
            scale=ctx.scale)
        return dq, dk, dv, None, None, None


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def packed_attention_flex(q, k, v, layout: DocumentLayout, scale: float):
    """flex_attention with a block-sparse document+causal mask (built once per batch)."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = q.shape[0]
    if layout.flex_block_mask is None:
        doc = layout.document_ids

        def same_doc_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        layout.flex_block_mask = create_block_mask(same_doc_causal, None, None, total, total, device=q.device)
    out = _compiled_flex()(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=layout.flex_block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def resolve_packed_backend(backend: PackedBackend, device: torch.device, dropout_p: float,
                           dtype: torch.dtype | None = None) -> str:
    if backend != "auto":
        return backend
    if device.type != "cuda":
        return "dense"
    if dropout_p > 0:
        return "dense"  # varlen/flex take no dropout; the dense path is exact and slow
    if dtype == torch.float32:
        return "dense"  # flash (varlen) kernels take 16-bit inputs only; fp32 is for proofs, not speed
    return "varlen" if varlen_available(device) else "flex"


# ---------------------------------------------------------------------------------------
# The core-attention module (drop-in for DotProductAttention in a ModuleSpec).
# ---------------------------------------------------------------------------------------


class FusedCoreAttention(MegatronModule):
    """Core attention on PyTorch's fused kernels; same constructor and forward as
    Megatron's ``DotProductAttention`` (q: [sq, b, np, hn], k/v: [sk, b, ng, hn] ->
    [sq, b, np * hn]), plus packed streams.

    Mask semantics follow ``DotProductAttention``: with ``attention_mask=None`` a causal
    layer is causal; a given boolean mask (True = masked out) replaces the causal mask.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        packed_backend: PackedBackend = "auto",
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise NotImplementedError("FusedCoreAttention supports context_parallel_size 1 only; use TE for CP")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"softmax_type {config.softmax_type!r} is not supported; only 'vanilla'")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError("sliding-window attention is not supported by FusedCoreAttention")
        if packed_backend not in ("auto", "varlen", "flex", "dense"):
            raise ValueError(f"packed_backend {packed_backend!r}: allowed are auto, varlen, flex, dense")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp)
        self.num_groups = divide(config.num_query_groups, tp)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        # DotProductAttention divides by the layer number and multiplies it back inside
        # its softmax (apply_query_key_layer_scaling): the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.packed_backend = packed_backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | DocumentsView | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by FusedCoreAttention")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, dropout_p)
        return self._unpacked(query, key, value, attention_mask, dropout_p)

    def _dropout_rng(self, dropout_p: float):
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _unpacked(self, query, key, value, attention_mask, dropout_p):
        sq, b = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        groups = self.num_heads // self.num_groups
        with self._dropout_rng(dropout_p):
            if attention_mask is None:
                causal = self.attn_mask_type == AttnMaskType.causal and sq > 1
                if causal and sq != k.shape[2]:
                    raise ValueError("a causal mask needs equal query and key lengths (training/prefill only)")
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, dropout_p=dropout_p, scale=self.softmax_scale,
                    enable_gqa=groups > 1,
                )
            else:
                if attention_mask.dtype != torch.bool:
                    raise TypeError(f"attention_mask must be bool (True = masked out), got {attention_mask.dtype}")
                # The efficient (masked) SDPA kernel takes no GQA: expand k/v to the query heads.
                out = F.scaled_dot_product_attention(
                    q, _repeat_kv(k, groups, 1), _repeat_kv(v, groups, 1),
                    attn_mask=~attention_mask, dropout_p=dropout_p, scale=self.softmax_scale,
                )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.num_heads * q.shape[-1])

    def _packed(self, query, key, value, params, dropout_p):
        layout = layout_of(params)
        thd = params.qkv_format == "thd"
        if params.qkv_format not in ("thd", DOCUMENTS_FORMAT):
            raise ValueError(f"packed qkv_format {params.qkv_format!r}: allowed are 'thd' and {DOCUMENTS_FORMAT!r}")
        if not thd:  # [T, 1, heads, dim] -> [T, heads, dim]
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        backend = resolve_packed_backend(self.packed_backend, query.device, dropout_p, query.dtype)
        if backend != "dense" and dropout_p > 0:
            raise NotImplementedError(f"attention dropout is not supported by the {backend} packed backend")
        with self._dropout_rng(dropout_p):
            if backend == "varlen":
                out = packed_attention_varlen(query, key, value, layout, self.softmax_scale)
            elif backend == "flex":
                out = packed_attention_flex(query, key, value, layout, self.softmax_scale)
            else:
                out = packed_attention_dense(query, key, value, layout, self.softmax_scale, dropout_p)
        total = out.shape[0]
        # thd: SelfAttention reshapes to [T, 1, hp] itself; the documents view is sbhd.
        return out.reshape(total, -1) if thd else out.reshape(total, 1, -1)


def _per_token_rotary(rotary_pos_emb, position_ids: torch.Tensor):
    """[max_seqlen, 1, 1, d] frequencies -> [T, 1, 1, d], one row per token's position."""
    if rotary_pos_emb is None:
        return None
    if isinstance(rotary_pos_emb, tuple):
        return tuple(_per_token_rotary(r, position_ids) for r in rotary_pos_emb)
    return rotary_pos_emb.index_select(0, position_ids)


class PackedSelfAttention(SelfAttention):
    """``SelfAttention`` whose packed (``thd``) path applies RoPE in one shot.

    For a ``thd`` batch it gathers the RoPE frequencies by per-token position (so every
    sequence starts at position 0, exactly as if it were alone) and hands the core
    attention a ``DocumentsView``: q, k, v stay [T, 1, heads, dim] and the core
    attention confines attention to each document. Unpacked batches are unchanged.
    """

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        params = kwargs.get("packed_seq_params")
        inference = kwargs.get("inference_context") is not None or kwargs.get("inference_params") is not None
        if args:
            raise TypeError("PackedSelfAttention takes everything after attention_mask by keyword")
        if params is not None and params.qkv_format == "thd" and not inference:
            layout = layout_of(params)
            kwargs["rotary_pos_emb"] = _per_token_rotary(kwargs.get("rotary_pos_emb"), layout.position_ids)
            kwargs["packed_seq_params"] = DocumentsView(layout)
        return super().forward(hidden_states, attention_mask, **kwargs)


# ---------------------------------------------------------------------------------------
# Layer spec and config switches.
# ---------------------------------------------------------------------------------------


def fused_gpt_layer_spec(config: TransformerConfig, packed_backend: PackedBackend = "auto") -> ModuleSpec:
    """Megatron's local GPT layer spec with ``PackedSelfAttention`` + ``FusedCoreAttention``."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    attention = spec.submodules.self_attention
    if attention.module is not SelfAttention:
        raise NotImplementedError(f"fused attention replaces SelfAttention only, not {attention.module.__name__}")
    attention.module = PackedSelfAttention
    attention.submodules.core_attention = functools.partial(FusedCoreAttention, packed_backend=packed_backend)
    return spec


def lorafleet_gpt_layer_spec(
    config: TransformerConfig, packed_backend: PackedBackend = "auto", prefer_te: bool = True
) -> ModuleSpec:
    """The layer spec the trainer builds with: TE's where TE imports, else the fused local one.

    Usable as a Megatron-Bridge provider's ``transformer_layer_spec`` (called with the
    provider). Keep ``attention_backend`` off ``local`` on that provider: Bridge then
    overwrites the core attention with ``DotProductAttention``.
    """
    if prefer_te and transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
        )
    return fused_gpt_layer_spec(config, packed_backend)


def recompute_overrides(mode: RecomputeMode, num_layers: int = 1) -> dict:
    """TransformerConfig fields for activation recomputation (set them before the model is built).

    - ``none``: keep every activation (fastest).
    - ``full``: keep only each layer's input, recompute the layer in backward
      (``recompute_method='uniform'``, ``num_layers`` layers per checkpoint): about a
      third more compute, activation memory ~ 2 * hidden bytes per token per layer.
    - ``selective``: recompute the MLP ("mlp"). With fused attention there is no score
      matrix left for "core_attn" to save, and "layernorm" is broken without TE in
      megatron-core 0.19.2 (``CheckpointWithoutOutput()`` sets ``fp8 = False is not None``
      and then calls TE's ``FP8GlobalStateManager``).
    """
    if mode == "none":
        return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if mode == "full":
        if num_layers < 1:
            raise ValueError(f"recompute num_layers must be >= 1, got {num_layers}")
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": num_layers}
    if mode == "selective":
        return {
            "recompute_granularity": "selective",
            "recompute_method": None,
            "recompute_num_layers": None,
            "recompute_modules": ["mlp"],
        }
    raise ValueError(f"recompute mode {mode!r}: allowed are none, full, selective")
