"""Per-slot LoRA on the unembedding (Megatron's ``output_layer``, Hugging Face's ``lm_head``).

The output projection W [V, H] (vocabulary-parallel under TP: each rank holds V/tp rows) gets,
per slot k, ``lora_A [R, H]`` and ``lora_B [V, R]``; slot k's tokens get the logits

    logits[t] = W x[t] + scale_k * B_k A_k x[t]          (t a token of slot k)

and every other slot's tokens none of it. ``UnembedLora`` is a ``MultiLoraLinear`` over the
output layer (a column-parallel linear: A replicated, B split over the vocabulary like W), so
the slot buffers, clipping, AdamW, swap, checkpoint and export treat it as any other target.

Two ways the logits are formed:
* the full-logits path (``forward``, what Megatron calls as ``output_layer``): the base logits
  plus the routed delta of multi_lora.py, gathered over TP afterwards when asked;
* the chunked log-prob path (trainer/kernels/chunked_logprobs.py, the trainer's default): Megatron hands
  the final hidden states to the output processor without calling the layer; ``logit_lora``
  gives that path ``z = scale * x A^T`` (differentiable, [T, R]) and B with the token segments of
  the slots that train the unembedding, and the chunked function adds ``z B_k^T`` to each chunk's
  logits before the log-softmax (never the full [T, V] logits).

Tied embeddings (the tiny Qwen3): Megatron's output layer holds no weight and is given the input
embedding's at each call; the LoRA sits on the output projection only, never on the input
embedding (which this module does not touch).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from trainer.config import TARGET_GROUPS
from trainer.lora.multi_lora import UNEMBED_MODULE, MultiLoraLinear, SlotRouting
from trainer.kernels.segmented_mm import pick_kernel, segmented_matmul

UNEMBED = TARGET_GROUPS.index("unembed")
HF_UNEMBED = "lm_head"  # Hugging Face's name of the output projection (PEFT target module)


class UnembedLora(MultiLoraLinear):
    """N LoRA slots on the output layer; returns what Megatron's output layer returns."""

    def __init__(self, base, *, output_weight: Callable[[], torch.Tensor], hf_module: str, num_slots: int,  # noqa: ANN001
                 max_rank: int, routing: SlotRouting, tp_group, device: torch.device) -> None:  # noqa: ANN001
        """``output_weight()``: the live output weight [V/tp, H] (the layer's own, or the input
        embedding's where they are tied)."""
        super().__init__(base, name=UNEMBED_MODULE, kind="plain", parallel="column", num_slots=num_slots,
                         max_rank=max_rank, routing=routing, tp_group=tp_group, device=device,
                         weight_shape=tuple(output_weight().shape))
        self._output_weight = output_weight
        self.hf_module = hf_module  # peft_io.hf_targets: the PEFT module name of this layer
        self.fusable = False  # called with keyword arguments (weight=, runtime_gather_output=): general path

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,  # noqa: D401 - Megatron's signature
                runtime_gather_output: bool | None = None):
        """Full logits: the base's vocab-local logits plus each routed token's slot delta, then the
        gather over TP that Megatron would have done (``runtime_gather_output``, else the layer's own)."""
        self.await_step()
        gather = runtime_gather_output if runtime_gather_output is not None else self.base.gather_output
        logits, bias = self.base(x, weight=weight, runtime_gather_output=False)
        r = self.routing
        if r.enabled and r.segments_training(UNEMBED):
            logits = logits + self._delta(x)
        if gather and self.tp_size > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
        return logits, bias

    def logit_lora(self, hidden: torch.Tensor):  # noqa: ANN201 - chunked_logprobs.LogitLora | None
        """What the chunked log-prob path adds to the logits of ``hidden`` [T, H] (tokens in the
        routing's sample-major order), or None when no routed token's slot trains the unembedding.

        ``z`` carries the slot's scale (0 rows for slots that do not train it) and its graph back to
        A and the hidden states; its gradient is summed over TP by the chunked function (B is split
        over the vocabulary, so each rank sees only its shard's part of it)."""
        from trainer.kernels.chunked_logprobs import LogitLora

        self.await_step()
        r = self.routing
        if not r.enabled:
            return None
        segments = r.segments_training(UNEMBED)
        if not segments:
            return None
        if hidden.shape[0] != r.batch * r.seq_len:
            raise RuntimeError(f"{self.name}: {hidden.shape[0]} tokens but routing was set for "
                               f"{r.batch} x {r.seq_len}")
        z = segmented_matmul(hidden, self.lora_A, r.offsets, r.counts, pick_kernel(r.kernel, hidden, self.lora_A))
        return LogitLora(z=z * r.scale_column(z.dtype, UNEMBED), lora_b=self.lora_B, segments=segments)

    @torch.no_grad()
    def check_base_copy(self, full: torch.Tensor, folder: str) -> None:
        """A PEFT folder made by HF peft with ``lm_head`` targeted also holds the base output weight
        (``lm_head.base_layer.weight``, peft's ``save_embedding_layers="auto"``); it is taken only if it
        IS this base's weight (a changed one is not a LoRA). ValueError otherwise. Collective over TP."""
        own = self._output_weight()
        v0 = self.tp_rank * self.out_local
        ok = tuple(full.shape) == (self.out_full, self.in_full) and torch.equal(
            full[v0 : v0 + self.out_local].to(own.device, own.dtype), own)
        flag = torch.tensor([0.0 if ok else 1.0], device=own.device)
        if self.tp_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.tp_group)
        if flag.item() != 0.0:
            raise ValueError(f"{folder}: {HF_UNEMBED}.base_layer.weight differs from this base model's output "
                             "weight; only LoRA (lora_A / lora_B) can be imported")


def install_unembed_lora(base, *, num_slots: int, max_rank: int, routing: SlotRouting, tp_group) -> UnembedLora:  # noqa: ANN001
    """Wrap ``base.model.output_layer`` in place (the unembedding's LoRA slots) and return it."""
    model = base.model
    output_layer = getattr(model, UNEMBED_MODULE, None)
    if output_layer is None:
        raise ValueError("the model has no output_layer to put LoRA on")
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight  # the input embedding's, as GPTModel passes it
    else:
        output_weight = lambda: output_layer.weight  # noqa: E731
    if output_weight() is None:
        raise ValueError("the output layer has no weight and the model shares none with it")
    # HF's causal LMs name the output projection lm_head whether or not it is tied (with tied
    # embeddings Bridge may map the weight to embed_tokens: the LoRA must not go there).
    wrapper = UnembedLora(output_layer, output_weight=output_weight, hf_module=HF_UNEMBED,
                          num_slots=num_slots, max_rank=max_rank, routing=routing, tp_group=tp_group, device=base.device)
    setattr(model, UNEMBED_MODULE, wrapper)
    return wrapper
