"""Frozen-base forward+backward of a Qwen3-shaped model: lorafleet's Megatron vs the rest.

One process, one device, one run, same tokens (default 16 x 1024), bf16:
  hf_sdpa              Hugging Face Qwen3 with SDPA attention, loss on full fp32 logits
  mcore_local          Megatron-core, local layer spec (unfused attention), full-logits loss
  mcore_fused          Megatron-core, lorafleet's fused attention spec, full-logits loss
  mcore_fused_chunked  + chunked log-probs (no full fp32 logits)          <- lorafleet's pass
  mcore_fused_packed   + the 16 sequences packed into one stream (varlen attention)
  trainer              lorafleet's trainer itself (MultiLoraTrainer built through Megatron-Bridge
                       with its defaults: packed, fused attention, chunked log-probs), its
                       frozen-base pass (benchmarks/trainer_floor.py frozen_base_pass: the mixed step's
                       path with LoRA off), one 16384-token micro-batch
The backward goes to the input embeddings only (the base is frozen), as in FINDINGS.md.
Reported: median ms, peak GiB (torch max_memory_allocated), TFLOP/s counting
4 x parameters x tokens, and the device's bf16 matmul TFLOP/s measured in the same run.

  python -m benchmarks.bench_frozen_base --out results.json          # the 1.7B shape, GPU
  python -m benchmarks.bench_frozen_base --shape tiny --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # eager everywhere: same footing for every stack

import torch  # noqa: E402

from benchmarks.failures import describe_failure  # noqa: E402

SHAPES = {
    # Qwen3-1.7B: 28 layers, hidden 2048, 16 heads, 8 kv heads, head_dim 128, ffn 6144, tied.
    "qwen3-1.7b": dict(num_layers=28, hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144, vocab=151936, rope_theta=1e6),
    "tiny": dict(num_layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=400, rope_theta=1e4),
}
GIB = 2**30


def setup_parallel(seed: int = 0) -> None:
    from trainer.platform.distributed import init_parallel

    init_parallel(tp=1, dp=1, seed=seed)


def transformer_config(shape: dict, dtype: torch.dtype, recompute: str = "none", init_std: float = 0.02):
    """Megatron config of a frozen Qwen3-shaped ``shape`` (also the GPU speed tests' models)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer.base.fused_attention import recompute_overrides

    on_cpu = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=shape["num_layers"], hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
        num_query_groups=shape["kv_heads"], kv_channels=shape["head_dim"], ffn_hidden_size=shape["ffn"],
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, qk_layernorm=True,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, cross_entropy_loss_fusion=False,
        use_cpu_initialization=on_cpu, init_method_std=init_std, **recompute_overrides(recompute),
    )


def build_megatron(shape: dict, spec: str, dtype: torch.dtype, recompute: str = "none", seed: int = 0):
    """A frozen random GPTModel with the 'fused' (lorafleet) or 'local' layer spec.

    Same seed -> same weights for both specs (identical parameter creation order)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from trainer.base.fused_attention import fused_gpt_layer_spec

    from trainer.base.base_model import freeze_in_dtype, triton_rope_enabled

    cfg = transformer_config(shape, dtype, recompute)
    if spec == "fused":  # lorafleet's spec comes with its Triton RoPE (trainer/base/base_model.py)
        cfg.apply_rope_fusion = triton_rope_enabled()
    layer_spec = (
        fused_gpt_layer_spec(cfg) if spec == "fused" else get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    model = GPTModel(
        cfg, layer_spec, vocab_size=shape["vocab"], max_sequence_length=8192, position_embedding_type="rope",
        rotary_base=shape["rope_theta"], share_embeddings_and_output_weights=True,
    )
    if torch.cuda.is_available():
        model = model.cuda()
    freeze_in_dtype(model, dtype)  # norm weights in bf16 too, as the trainer has them
    return model.train()  # train(): recomputation runs only in training mode; no dropout anyway


def build_hf(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=shape["rope_theta"], attention_dropout=0.0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.train()


def count_params(model, frozen_only: bool = False) -> int:
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique if not (frozen_only and p.requires_grad))


# ---- one frozen-base step per stack: forward, scalar loss, backward to the input embeddings ----


def hf_step(model, ids):
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    loss = model(inputs_embeds=emb, labels=ids).loss
    loss.backward()
    return loss.detach()


def _mcore_embed(model, tokens, position_ids):
    return model.embedding(tokens, position_ids).detach().requires_grad_()


def mcore_full_logits_step(model, ids):
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    emb = _mcore_embed(model, ids, pos)
    labels = torch.roll(ids, -1, dims=1)
    loss = model(ids, pos, None, decoder_input=emb, labels=labels).mean()  # megatron's fp32 vocab CE
    loss.backward()
    return loss.detach()


def mcore_chunked_step(model, ids, chunk_size=2048):
    from trainer.kernels.chunked_logprobs import LogprobOutputProcessor

    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    emb = _mcore_embed(model, ids, pos)
    labels = torch.roll(ids, -1, dims=1)
    lp = model(ids, pos, None, decoder_input=emb, output_processor=LogprobOutputProcessor(chunk_size),
               output_processor_context=labels)
    loss = -lp.mean()
    loss.backward()
    return loss.detach()


def mcore_packed_step(model, packed, chunk_size=2048):
    """One packed stream: fused varlen attention + chunked log-probs (lorafleet's mixed-step pass)."""
    from trainer.kernels.chunked_logprobs import LogprobOutputProcessor

    targets, valid = packed.next_token_targets()
    emb = _mcore_embed(model, packed.tokens, packed.position_ids)
    lp = model(packed.tokens, packed.position_ids, None, decoder_input=emb,
               packed_seq_params=packed.packed_seq_params,
               output_processor=LogprobOutputProcessor(chunk_size), output_processor_context=targets.unsqueeze(0))
    loss = -(lp.sum() / valid.sum())
    loss.backward()
    return loss.detach()


# ---- timing ---------------------------------------------------------------------------------


def build_trainer(shape: dict, tokens: int, seed: int = 0):
    """lorafleet's MultiLoraTrainer on a random model of ``shape`` (config-only HF folder),
    one resident slot (the frozen-base pass does not use it), micro-batches of ``tokens``."""
    import tempfile

    from transformers import Qwen3Config

    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    cfg = Qwen3Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], tie_word_embeddings=True,
        max_position_embeddings=8192, rope_theta=shape["rope_theta"], rms_norm_eps=1e-6, attention_bias=False,
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    with tempfile.TemporaryDirectory() as folder:
        cfg.save_pretrained(folder)
        return MultiLoraTrainer(TrainerConfig(base_model_path=folder, random_init=True, num_slots=1, max_rank=16,
                                              micro_batch_tokens=tokens, seed=seed))


def trainer_batch(ids):
    from trainer.batch import TrainBatch, TrainSample

    rows = ids.cpu().tolist()
    return TrainBatch(samples=[TrainSample(slot=0, tokens=r, loss_mask=[0] + [1] * (len(r) - 1)) for r in rows])


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, warmup: int, iters: int) -> dict:
    """Median wall ms of ``step`` (synchronized) and the peak memory over all calls."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    loss = None
    for _ in range(warmup):
        loss = step()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "peak_gib": peak / GIB,
        "weights_gib": base / GIB,
        "loss": float(loss) if loss is not None else None,
    }


def matmul_tflops(n: int = 8192, iters: int = 20) -> float:
    """bf16 n x n x n matmul rate on random data (the device's ceiling for this run)."""
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * n**3 / statistics.median(times) / 1e12


def attention_probe(batch: int = 16, seq: int = 1024, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> dict:
    """fwd+bwd ms of the attention kernels alone at the benchmark's shape: where does packing cost?"""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.base import fused_attention as fa
    from trainer.base.packing import DocumentLayout

    out = {}
    if not torch.cuda.is_available():
        return out
    fn, params = fa._varlen_fn() or (None, frozenset())
    out["varlen_signature"] = sorted(params)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, kv_heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    layout = DocumentLayout.from_lengths([seq] * batch, device="cuda")
    qt, kt, vt = (x.transpose(1, 2).reshape(-1, x.shape[1], dim).contiguous() for x in (q, k, v))
    rep = heads // kv_heads

    def bench(f, *xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        for _ in range(3):
            f(*xs).sum().backward()
        sync()
        t0 = time.perf_counter()
        for _ in range(10):
            f(*xs).sum().backward()
        sync()
        return (time.perf_counter() - t0) * 100  # ms per fwd+bwd

    cases = {
        "sdpa_auto_gqa": lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
        "sdpa_repeat_kv": lambda a, b, c: F.scaled_dot_product_attention(
            a, b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1), is_causal=True),
        "varlen": lambda a, b, c: fa.packed_attention_varlen(a, b, c, layout, dim**-0.5),
    }
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        def forced(a, b, c, _be=getattr(SDPBackend, backend)):
            with sdpa_kernel([_be]):
                return F.scaled_dot_product_attention(
                    a, b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1), is_causal=True)
        cases[f"sdpa_{backend.lower()}_repeat_kv"] = forced
    for name, f in cases.items():
        try:
            out[name] = bench(f, qt, kt, vt) if name == "varlen" else bench(f, q, k, v)
        except Exception as exc:
            out[name] = describe_failure(exc)
        print(f"attention {name:34s} {out[name] if isinstance(out[name], str) else f'{out[name]:.3f} ms'}", flush=True)
    return out


def free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(shape_name: str, batch: int, seq: int, warmup: int, iters: int, variants: list[str]) -> dict:
    from benchmarks.trainer_floor import frozen_base_pass

    from trainer.base.packing import pack_sequences

    shape = SHAPES[shape_name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setup_parallel()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (batch, seq), generator=g).to(device)
    tokens = batch * seq
    result = {
        "shape": shape_name, "batch": batch, "seq": seq, "tokens": tokens, "dtype": str(dtype),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "matmul_bf16_tflops": matmul_tflops(), "variants": {},
    }
    params = None
    for name in variants:
        model = trainer = None
        try:
            if name == "hf_sdpa":
                model = build_hf(shape, dtype, device)
                step = lambda: hf_step(model, ids)  # noqa: E731
            elif name == "trainer":
                trainer = build_trainer(shape, tokens)
                model = trainer.base.model
                batch_in = trainer_batch(ids)
                step = lambda: torch.tensor(frozen_base_pass(trainer, batch_in))  # noqa: E731
            else:
                model = build_megatron(shape, "local" if name == "mcore_local" else "fused", dtype)
                if name in ("mcore_local", "mcore_fused"):
                    step = lambda: mcore_full_logits_step(model, ids)  # noqa: E731
                elif name == "mcore_fused_chunked":
                    step = lambda: mcore_chunked_step(model, ids)  # noqa: E731
                elif name == "mcore_fused_packed":
                    packed = pack_sequences(list(ids.cpu()), [0] * batch, num_slots=1, device=device)
                    step = lambda: mcore_packed_step(model, packed)  # noqa: E731
                else:
                    raise ValueError(f"unknown variant {name}")
            n_params = count_params(model, frozen_only=name == "trainer")  # not the trainer's LoRA slot
            params = params or n_params
            r = timed(step, warmup, iters)
            r["params"] = n_params
            r["tflops"] = 4 * n_params * tokens / (r["median_ms"] / 1e3) / 1e12
            result["variants"][name] = r
            print(f"{name:22s} {r['median_ms']:9.1f} ms  peak {r['peak_gib']:6.1f} GiB  "
                  f"{r['tflops']:6.1f} TFLOP/s  loss {r['loss']:.4f}", flush=True)
        except Exception as exc:  # keep measuring the others; the error is part of the result
            result["variants"][name] = {"error": describe_failure(exc), "trace": traceback.format_exc()[-2000:]}
            print(f"{name}: FAILED {describe_failure(exc)}", flush=True)
        finally:
            del model
            step = trainer = None
            free()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--variants", default="hf_sdpa,mcore_local,mcore_fused,mcore_fused_chunked,mcore_fused_packed,trainer")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--attention-probe", action="store_true", help="also time the attention kernels alone")
    args = parser.parse_args()
    probe = attention_probe() if args.attention_probe else None
    result = run(args.shape, args.batch, args.seq, args.warmup, args.iters, args.variants.split(","))
    print(f"bf16 matmul {result['matmul_bf16_tflops']:.0f} TFLOP/s on {result['device']}")
    if probe is not None:
        result["attention_probe"] = probe
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
