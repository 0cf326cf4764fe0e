"""The FP8 half of the Transformer Engine double: ``Float8Quantizer`` and ``Float8Tensor``.

Split from ``te_fused_adam.py`` (which re-exports these names); what is reproduced and why is
documented there (behaviour 9). Read from TE's ``pytorch/tensor/float8_tensor.py``,
``pytorch/tensor/storage/float8_tensor_storage.py`` and ``pytorch/quantized_tensor.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from typing import Optional

import torch
from torch.utils._pytree import tree_map

aten = torch.ops.aten


def _default_device() -> torch.device:
    """Where TE allocates when no device is given (``torch.device('cuda')`` in TE)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DType(enum.Enum):
    """Stand-in for ``transformer_engine_torch.DType`` (the FP8 formats only)."""

    kFloat8E4M3 = "e4m3"
    kFloat8E5M2 = "e5m2"


_FP8_TORCH = {DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2}


# ----------------------------------------------------------------------------- FP8 tensors
class Float8Quantizer:
    """Per-tensor delayed-scaling quantizer (``transformer_engine.pytorch.Float8Quantizer``)."""

    def __init__(
        self,
        scale: torch.Tensor,
        amax: torch.Tensor,
        fp8_dtype: DType,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
    ) -> None:
        if fp8_dtype is not DType.kFloat8E4M3:
            raise NotImplementedError("the FusedAdam double reproduces FP8 E4M3 moments only")
        self.scale = scale
        self.amax = amax
        self.dtype = fp8_dtype
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False

    def copy(self) -> "Float8Quantizer":
        """A new quantizer sharing ``scale`` and ``amax`` (as TE's ``Quantizer.copy``)."""
        return Float8Quantizer(
            self.scale,
            self.amax,
            self.dtype,
            rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage,
        )

    def make_empty(
        self,
        shape: Iterable[int],
        *,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
        requires_grad: bool = False,
        pin_memory: bool = False,
    ) -> "Float8Tensor":
        device = _default_device() if device is None else torch.device(device)
        shape = torch.Size(shape)
        data = torch.empty(shape, dtype=torch.uint8, device=device)
        transpose = None
        if self.columnwise_usage:
            transpose = torch.empty(
                [data.size(-1)] + list(data.shape[:-1]), dtype=torch.uint8, device=device
            )
        return Float8Tensor(
            shape=shape,
            dtype=dtype,
            data=data,
            fp8_scale_inv=torch.empty(1, dtype=torch.float32, device=device),
            fp8_dtype=self.dtype,
            data_transpose=transpose,
            quantizer=self,
            requires_grad=requires_grad,
        )

    def update_quantized(self, src: torch.Tensor, dst: "Float8Tensor", *, noop_flag=None):
        """``tex.quantize(src, self, dst)``: cast into ``dst``'s existing buffers, in place."""
        if not isinstance(dst, Float8Tensor):
            raise ValueError("Float8Quantizer can only update Float8Tensor")
        if noop_flag is not None:
            raise NotImplementedError("noop_flag is not reproduced by the double")
        src = src.to(device=dst._data.device).contiguous()
        x = src.float()
        with torch.no_grad():
            dst._data.copy_(_cast_to_fp8(x * self.scale, self.dtype).view(dst._data.shape))
            self.amax.copy_(torch.maximum(self.amax, x.abs().amax().reshape(self.amax.shape)))
            dst._scale_inv.copy_(torch.reciprocal(self.scale).reshape(dst._scale_inv.shape))
            if dst._transpose is not None and self.columnwise_usage:
                _write_transpose(dst)
        dst._fp8_dtype = self.dtype
        return dst

    def __repr__(self) -> str:
        return f"Float8Quantizer(scale={self.scale.tolist()}, amax={self.amax.tolist()})"


def _cast_to_fp8(x: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    """fp32 -> FP8 bits (uint8), saturating to the finite range like CUDA's satfinite cast."""
    fp8 = _FP8_TORCH[fp8_dtype]
    limit = torch.finfo(fp8).max
    return x.clamp(-limit, limit).to(fp8).view(torch.uint8)


def _write_transpose(tensor: "Float8Tensor") -> None:
    last = tensor._data.shape[-1] if tensor._data.dim() else 1
    rows = tensor._data.reshape(-1, last)
    tensor._transpose.view(last, -1).copy_(rows.t())
    tensor._transpose_invalid = False


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


class Float8Tensor(torch.Tensor):
    """FP8 data presented as a higher-precision tensor (``.dtype`` is the nominal dtype).

    A wrapper subclass: the object itself owns no memory. Everything lives in ``_data``,
    ``_transpose`` and ``_scale_inv``, as in TE's ``Float8TensorStorage``.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        *,
        shape,
        dtype: torch.dtype,
        data: torch.Tensor,
        fp8_scale_inv: torch.Tensor,
        fp8_dtype: DType,
        data_transpose: Optional[torch.Tensor] = None,
        quantizer: Optional[Float8Quantizer] = None,
        requires_grad: bool = False,
    ):
        shape = torch.Size(shape)
        instance = torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_contiguous_strides(shape),
            storage_offset=0,
            dtype=dtype,
            layout=torch.strided,
            requires_grad=requires_grad,
            device=data.device,
        )
        instance._data = data
        instance._quantizer = quantizer.copy() if quantizer is not None else None
        instance._fp8_dtype = fp8_dtype
        instance._scale_inv = fp8_scale_inv
        instance._transpose = data_transpose
        instance._transpose_invalid = data_transpose is None
        return instance

    def __init__(self, *args, **kwargs) -> None:  # everything happens in __new__
        super().__init__()

    # -- TE's Python-level API --------------------------------------------------------------
    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        dtype = self.dtype if dtype is None else dtype
        if self._data is None:
            raise NotImplementedError("Casting back from the transpose not implemented yet!")
        values = self._data.view(_FP8_TORCH[self._fp8_dtype]).float() * self._scale_inv
        return values.to(dtype)

    def float(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float32)

    def bfloat16(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.bfloat16)

    def half(self) -> torch.Tensor:
        return self.dequantize(dtype=torch.float16)

    def cpu(self, memory_format=torch.preserve_format) -> torch.Tensor:
        return self.dequantize().cpu(memory_format=memory_format)

    def quantize_(self, tensor: torch.Tensor, *, noop_flag=None) -> "Float8Tensor":
        if isinstance(tensor, Float8Tensor):
            return self.quantize_(tensor.dequantize(), noop_flag=noop_flag)
        if self._quantizer is None:
            raise ValueError("Float8Tensor's quantizer is None, cannot quantize into it")
        self._quantizer.update_quantized(tensor, self, noop_flag=noop_flag)
        return self

    def get_metadata(self) -> dict:
        return {
            "data": self._data,
            "fp8_scale_inv": self._scale_inv,
            "fp8_dtype": self._fp8_dtype,
            "data_transpose": self._transpose,
            "quantizer": self._quantizer,
        }

    @classmethod
    def make_like(
        cls, tensor: "Float8Tensor", *, shape=None, dtype=None, requires_grad=False, **overrides
    ):
        kwargs = tensor.get_metadata()
        kwargs.update(overrides)
        return cls(
            shape=tensor.shape if shape is None else shape,
            dtype=tensor.dtype if dtype is None else dtype,
            requires_grad=requires_grad,
            **kwargs,
        )

    def detach(self) -> "Float8Tensor":
        return Float8Tensor.make_like(self)

    def clone(self) -> "Float8Tensor":
        # As TE: new data and transpose, the same scale-inverse tensor.
        transpose = None if self._transpose is None else self._transpose.detach().clone()
        return Float8Tensor.make_like(
            self, data=self._data.detach().clone(), data_transpose=transpose
        )

    def view(self, *shape) -> "Float8Tensor":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        data = self._data.view(*shape)
        transpose = None if self._transpose_invalid else self._transpose
        if transpose is not None and (
            transpose.size(0) != data.size(-1)
            or tuple(transpose.shape[1:]) != tuple(data.shape[:-1])
        ):
            transpose = None
        return Float8Tensor.make_like(self, shape=data.shape, data=data, data_transpose=transpose)

    def contiguous(self, memory_format=torch.contiguous_format) -> "Float8Tensor":
        return self

    def remove_caches(self) -> None:
        self._transpose_invalid = True
        self._transpose = None

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"Float8Tensor(fp8_dtype={self._fp8_dtype}, scale_inv={self._scale_inv.item()}, "
            f"data={self.dequantize(dtype=self.dtype)})"
        )

    def __reduce_ex__(self, protocol):
        # TE pickles the raw data without the quantizer; the double does the same.
        return (
            _rebuild_float8,
            (self._data, self._fp8_dtype, self._scale_inv, self.dtype, tuple(self.shape)),
        )

    # -- aten dispatch (QuantizedTensor.__torch_dispatch__ + Float8Tensor's overrides) --------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            return args[0].detach()
        if func is aten.clone.default:
            return args[0].clone()
        if func is aten.view.default:
            return args[0].view(*args[1:])
        if func is aten.numel.default:
            return math.prod(args[0].shape)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, Float8Tensor) and isinstance(src, Float8Tensor):
                dst._data.copy_(src._data.detach())
                dst._scale_inv.copy_(src._scale_inv.view(dst._scale_inv.size()))
                if dst._transpose is not None and not dst._transpose_invalid:
                    # As TE: the source's transpose is READ when it is valid (so a transpose
                    # left stale in memory would propagate), rebuilt from the data otherwise.
                    if not src._transpose_invalid:
                        dst._transpose.copy_(src._transpose)
                    else:
                        _write_transpose(dst)
                return dst
            if isinstance(dst, Float8Tensor):
                dst.quantize_(src)
                return dst
            dtype = (
                dst.dtype
                if dst.dtype in (torch.float32, torch.float16, torch.bfloat16)
                else torch.float32
            )
            dst.copy_(src.dequantize(dtype=dtype))
            return dst
        if func is aten.empty_like.default:
            tensor = args[0]
            return tensor._quantizer.make_empty(
                tensor.shape, dtype=tensor.dtype, device=kwargs.get("device", tensor.device)
            )

        def unwrap(value):
            return value.dequantize() if isinstance(value, Float8Tensor) else value

        if func._schema.is_mutable:
            new_args = tree_map(unwrap, args)
            new_kwargs = tree_map(unwrap, kwargs)
            func(*new_args, **new_kwargs)
            for arg, new_arg, schema_arg in zip(args, new_args, func._schema.arguments):
                alias = getattr(schema_arg, "alias_info", None)
                if isinstance(arg, Float8Tensor) and alias is not None and alias.is_write:
                    arg.quantize_(new_arg)
            return args[0]
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _rebuild_float8(data, fp8_dtype, scale_inv, dtype, shape):
    return Float8Tensor(
        shape=shape, dtype=dtype, data=data, fp8_scale_inv=scale_inv, fp8_dtype=fp8_dtype
    )
