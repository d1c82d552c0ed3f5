"""The SDK's protobuf bodies: forward_backward requests in, ForwardBackwardOutput out.

The SDK posts forward_backward (and forward, as ``forward_only``) as
``application/x-protobuf`` (zstd-compressed when the server's client config asks for
it; ours does not), and asks for ForwardBackwardOutput results as protobuf. The
message classes are the SDK's own generated module (``tinker.proto``), so the two
sides cannot drift apart. Only text chunks are accepted (no images or audio). A datum's
provenance spans (``Datum.with_provenance``) are read into ``provenance`` (one entry per
datum, None without): what stable_reinforce checks against the sampling records
(api/tinker/sampling/stability.py). The one text value of ``loss_fn_config`` is ``loss_id``: the
server-side custom loss (create_custom_loss) a ``custom`` call names (``ForwardBackwardBody.loss_id``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from api.tinker.sampling.stability import Provenance, Span
from trainer.rounds import CallResult, Datum

PROTO_CONTENT_TYPE = "application/x-protobuf"


def _pb():  # noqa: ANN202 - generated module
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class ForwardBackwardBody:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[Datum]
    provenance: list[Provenance | None] = field(default_factory=list)  # per datum
    loss_id: str | None = None  # loss_fn "custom": the custom loss it names (api/tinker/custom_losses.py)


_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def _tensor(msg, what: str) -> torch.Tensor:  # noqa: ANN001 - pb Tensor
    if msg.HasField("sparse_csr"):
        raise ValueError(f"{what}: sparse tensors are not supported; send dense arrays")
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"{what}: dtype {msg.dtype} not supported (float32 or int64)")
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    shape = list(msg.shape) or [arr.size]
    if int(np.prod(shape)) != arr.size:
        raise ValueError(f"{what}: shape {shape} does not match its {arr.size} values")
    t = torch.from_numpy(arr.reshape(shape))
    return t.to(torch.int64) if dtype != np.float32 else t


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> ForwardBackwardBody:
    """ValueError with what was wrong for a body that is not a usable request."""
    if content_encoding and content_encoding.lower() == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 30)
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ValueError(f"body is not a ForwardBackwardRequest protobuf: {err}") from None
    loss_id = None
    if msg.loss_fn_config_v2:
        config: dict[str, float] = {}
        for k, v in msg.loss_fn_config_v2.items():
            if v.WhichOneof("value") != "text":
                config[k] = v.number
            elif k == "loss_id" and msg.loss_fn == "custom":
                loss_id = v.text
            else:
                raise ValueError(f"loss_fn_config[{k!r}] is text; only numbers are supported (and loss_id, the text "
                                 "that names a custom loss for loss_fn 'custom')")
    else:
        config = dict(msg.loss_fn_config)
    if msg.loss_fn == "custom" and (loss_id is None or config):
        raise ValueError("loss_fn 'custom' takes loss_fn_config {'loss_id': <the id create_custom_loss answered>} "
                         f"and nothing else, got {sorted(config) + (['loss_id'] if loss_id else [])}")
    data, provenance = [], []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk") if chunk.DESCRIPTOR.oneofs else None
            if kind not in (None, "encoded_text"):
                raise ValueError(f"datum {i}: model_input chunk kind {kind!r} not supported; only encoded text")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {k: _tensor(v, f"datum {i}: loss_fn_inputs[{k!r}]") for k, v in d.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
        provenance.append(_provenance(d, i))
    return ForwardBackwardBody(model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=msg.loss_fn, loss_fn_config=config,
                               forward_only=msg.forward_only, data=data, provenance=provenance, loss_id=loss_id)


def _provenance(d, i: int) -> Provenance | None:  # noqa: ANN001 - a pb Datum
    if not d.model_input_spans and not d.loss_fn_input_spans:
        return None
    if not d.model_input_spans or not d.loss_fn_input_spans:
        raise ValueError(f"datum {i}: provenance comes as a pair: model_input_spans and loss_fn_input_spans, or neither")

    def spans(field_name: str, listed) -> tuple[Span, ...]:  # noqa: ANN001 - repeated pb ProvenanceSpan
        out = []
        for j, p in enumerate(listed):
            arm = p.WhichOneof("span")
            if arm is None:
                raise ValueError(f"datum {i}: {field_name}[{j}] is neither a prompt nor a sampled span")
            s = p.sampled_tokens if arm == "sampled_tokens" else p.prompt_tokens
            if s.offset < 0 or s.length < 0 or not s.sequence_id:
                raise ValueError(f"datum {i}: {field_name}[{j}] needs a sequence_id, offset >= 0 and length >= 0")
            out.append(Span(arm == "sampled_tokens", s.sequence_id, int(s.offset), int(s.length)))
        return tuple(out)

    return Provenance(spans("model_input_spans", d.model_input_spans), spans("loss_fn_input_spans", d.loss_fn_input_spans))


def encode_forward_backward_output(result: CallResult) -> bytes:
    """The datums' outputs (float32) as ArrayRecords: one record per run of consecutive datums whose
    outputs share a trailing shape ([n]: none; a top-K cross_entropy datum's [n, K]: (K,)), each
    field one flat array per datum with its byte offsets; the SDK reads the records in order and
    reshapes each datum's array by its record's trailing shape."""
    pb = _pb()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=result.metrics)
    runs: list[tuple[tuple[int, ...], list[dict]]] = []
    for o in result.outputs:
        trailing = tuple(next(iter(o.values())).shape[1:]) if o else ()
        if not runs or runs[-1][0] != trailing:
            runs.append((trailing, []))
        runs[-1][1].append(o)
    for trailing, outputs in runs or [((), [])]:
        record = out.loss_fn_outputs.add()
        record.type_tag = "ArrayRecord"
        record.num_datums = len(outputs)
        for name in (outputs[0] if outputs else {}):
            arrays = [o[name].numpy().astype(np.float32).ravel() for o in outputs]
            offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb.DTYPE_FLOAT32
            bt.trailing_shape.extend(trailing)
    return out.SerializeToString()
