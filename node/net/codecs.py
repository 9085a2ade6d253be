"""The codecs of the wire: hivemind's fp16, its 8-bit codec with a NumPy fix, and our blockwise
int8 (protocols/compression.py) in hivemind's registry."""

from __future__ import annotations

import numpy as np
import torch
from hivemind.compression import (
    CompressionBase,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    Uniform8BitQuantization,
)
from hivemind.compression import serialization as hivemind_serialization
from hivemind.proto import runtime_pb2
from islands.protocols.compression import BLOCK, dequantize_blockwise, quantize_blockwise


class FixedUniform8BitQuantization(Uniform8BitQuantization):
    """hivemind 1.1.12's 8-bit codec with its NumPy >= 2.4 bug fixed.

    Its `extract` calls int() on a one-element array, which NumPy 2.4 refuses; the
    error is swallowed inside the all-reduce, so a round "succeeds" with parts of
    the vector left unaveraged. Same wire format, so peers interoperate.
    """

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)


class BlockwiseInt8(CompressionBase):
    """`--compression int8` on the wire: blockwise absmax int8 (protocols/compression.py).

    It takes the BLOCKWISE_8BIT slot of hivemind's registry, whose own codec
    needs bitsandbytes; every island of a run uses this class, as it uses IslandAverager.
    """

    compression_type = runtime_pb2.BLOCKWISE_8BIT

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        codes, scales = quantize_blockwise(tensor)
        header = np.array([BLOCK, scales.numel()], dtype=np.int64).tobytes()
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=header + scales.numpy().tobytes() + codes.numpy().tobytes(),
            size=tensor.shape,
            dtype=str(tensor.dtype).removeprefix("torch."),
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        block, num_scales = (int(v) for v in np.frombuffer(buffer, count=2, dtype=np.int64))
        scales = torch.from_numpy(np.frombuffer(buffer, offset=16, count=num_scales, dtype=np.float32).copy())
        codes = torch.from_numpy(np.frombuffer(buffer, offset=16 + 4 * num_scales, dtype=np.int8).copy())
        values = dequantize_blockwise(codes, scales, block).reshape(tuple(serialized_tensor.size))
        return values.to(getattr(torch, serialized_tensor.dtype)).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return (1 + 4 / BLOCK) / 4


def install_codec_fixes() -> None:
    """Receivers decode by hivemind's registry, not by our codec object: register ours.

    Must run before the averager processes fork (they inherit it)."""
    registry = hivemind_serialization._BASE_COMPRESSION_TYPES
    registry["UNIFORM_8BIT"] = FixedUniform8BitQuantization()
    registry["BLOCKWISE_8BIT"] = BlockwiseInt8()


def compression_codec(name: str) -> CompressionBase:
    return {"none": NoCompression, "fp16": Float16Compression, "int8": BlockwiseInt8}[name]()


def consensus_compression(compression: str) -> str:
    """The codec of a consensus round, which averages the agreed values and momentum themselves:
    hivemind sends each member's values to the reducers through the codec, and blockwise int8 on
    values (not on a small update) is an error of ~1/255 of each block's range, which spoiled the
    agreed model (bench.parity, int8: 2.2551 against 2.1692 for the local model, 9 consensus
    rounds). fp16 is ~5e-4 of each value; `none` stays lossless."""
    return "none" if compression == "none" else "fp16"
