"""trainer/export/safetensors_stream.py against safetensors itself: the same bytes as `save_file`, read
back by `load_file`, for the dtypes an export writes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.export.safetensors_stream import write_safetensors


def _peft_like(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{ab}.weight": torch.randn(4, 6 + i, generator=g).to(dtype)
            for i in range(11) for m in ("q_proj", "o_proj") for ab in "AB"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_equal_safetensors_own_writer(tmp_path, dtype):
    tensors = _peft_like(dtype)
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_mixed_dtypes_empty_and_scalar_tensors(tmp_path):
    tensors = {"b": torch.ones(2, dtype=torch.bfloat16), "a": torch.arange(3.0), "empty": torch.zeros(0, 5),
               "scalar": torch.tensor(3.5), "ids": torch.arange(4), "half": torch.full((2, 2), 0.5, dtype=torch.float16)}
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_shared_storage_is_written_twice(tmp_path):
    """Fused q/k/v share one lora_A tensor; safetensors' save_file refuses that, this writes each."""
    a = torch.randn(4, 8)
    tensors = {"q.lora_A.weight": a, "k.lora_A.weight": a, "row_view": torch.randn(3, 8)[1]}
    write_safetensors(tmp_path / "x.safetensors", tensors)
    back = load_file(str(tmp_path / "x.safetensors"))
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_refuses_what_it_cannot_write_and_says_why(tmp_path):
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        write_safetensors(tmp_path / "x.safetensors", {"t": torch.randn(4, 4).t()})
    with pytest.raises(ValueError, match="dtype torch.complex64 is not one of"):
        write_safetensors(tmp_path / "x.safetensors", {"t": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_body_gives_the_same_file(tmp_path, dtype):
    """A publish snapshot: every tensor back to back in one body, in file order, written at once."""
    from trainer.export.safetensors_stream import file_order, packed_header, write_packed

    tensors = _peft_like(dtype)
    names = file_order({k: (v.dtype, v.shape) for k, v in tensors.items()})
    body = torch.cat([tensors[k].reshape(-1) for k in names])
    entries = [(k, tuple(tensors[k].shape)) for k in names]
    write_packed(tmp_path / "packed.safetensors", packed_header(entries, dtype, metadata={"format": "pt"}), body)
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "packed.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
    with pytest.raises(ValueError, match="must be in file order"):
        packed_header(entries[::-1], dtype)
    with pytest.raises(ValueError, match="entries hold .* bytes, body has"):
        write_packed(tmp_path / "x.safetensors", packed_header(entries[:-1], dtype), body)
    assert not (tmp_path / "x.safetensors").exists()
