"""The Tinker SDK's protobuf messages (its ``tinker_public`` schema, imported from the ``tinker`` package): a
``forward_backward`` request in, ``ForwardBackwardOutput`` and ``SampleResponse`` results out. Token ids travel
as little-endian int32 bytes, float tensors as float32 bytes."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from rlplat_tinker.datums import Datum
from rlplat_tinker.losses import RequestError

DENSE_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}


def schema() -> Any:
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def read_forward_backward(body: bytes, encoding: str | None) -> dict[str, Any]:
    """``{model_id, seq_id, loss_fn, loss_fn_config, forward_only, data: [Datum]}`` from the request's bytes."""
    if encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    request = schema().ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as error:  # protobuf's DecodeError
        raise RequestError(f"forward_backward: the body is not a ForwardBackwardRequest ({error})") from None
    config: dict[str, Any] = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        config[key] = value.number if value.WhichOneof("value") == "number" else value.text
    data = []
    for index, datum in enumerate(request.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise RequestError(f"datum {index}: only encoded_text chunks are served (a text model), got {chunk.WhichOneof('chunk')}")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist())
        inputs = {key: tensor_values(tensor, f"datum {index}: loss_fn_inputs[{key!r}]") for key, tensor in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return {"model_id": request.model_id, "seq_id": request.seq_id, "loss_fn": request.loss_fn, "loss_fn_config": config,
            "forward_only": request.forward_only, "data": data}


def tensor_values(tensor: Any, where: str) -> list[float]:
    if tensor.WhichOneof("encoding") != "dense":
        raise RequestError(f"{where}: a sparse tensor; send each datum's inputs as a dense 1-D tensor")
    if tensor.dtype not in DENSE_DTYPES:
        raise RequestError(f"{where}: dtype {tensor.dtype} is not float32, int64 or int32")
    values = np.frombuffer(tensor.dense, dtype=np.dtype(DENSE_DTYPES[tensor.dtype]).newbyteorder("<"))
    if len(tensor.shape) > 1:
        raise RequestError(f"{where}: shape {list(tensor.shape)}; each datum's inputs are 1-D, one value per input token")
    return values.tolist()


def forward_backward_output(logprobs: Sequence[Sequence[float]], metrics: dict[str, float]) -> bytes:
    """One ``ArrayRecord`` of every datum's ``logprobs`` (float32, byte offsets per datum) and the metrics."""
    pb = schema()
    arrays = [np.asarray(values, dtype="<f4") for values in logprobs]
    offsets = np.cumsum([0] + [array.nbytes for array in arrays]).astype("<i8")
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays))
    record.fields["logprobs"].CopyFrom(pb.BatchedTensor(data=b"".join(array.tobytes() for array in arrays),
                                                        offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32))
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        output.metrics[key] = float(value)
    return output.SerializeToString()


def sample_response(sequences: Sequence[tuple[list[int], list[float], str]], prompt_logprobs: Sequence[float | None] | None) -> bytes:
    """``sequences``: per sample its tokens, their log-probs and ``stop`` or ``length``; ``prompt_logprobs`` (None at
    position 0) when asked."""
    pb = schema()
    response = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        response.sequences.append(pb.SampledSequence(
            stop_reason=pb.STOP_REASON_STOP if reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype="<i4").tobytes(), logprobs=np.asarray(logprobs, dtype="<f4").tobytes()))
    if prompt_logprobs is not None:
        values = [math.nan if value is None else value for value in prompt_logprobs]
        response.prompt_logprobs = np.asarray(values, dtype="<f4").tobytes()
    return response.SerializeToString()
