"""Type stubs for the compiled part of dlbridge (checked against the module by stubtest)."""

import builtins
import enum
import sys
from collections.abc import Sequence
from typing import Any, Callable, Final, SupportsIndex, final

__all__ = [
    "Tensor",
    "DType",
    "Device",
    "DeviceType",
    "from_dlpack",
    "asdlpack",
    "shared_empty",
    "share",
    "__dlpack_version__",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "bool",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "float4_e2m1fn_x2",
    "bcomplex32",
]

__dlpack_version__: Final[tuple[int, int]]

class DeviceType(enum.IntEnum):
    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    ROCM_HOST = 11
    EXT_DEV = 12
    CUDA_MANAGED = 13
    ONE_API = 14
    WEBGPU = 15
    HEXAGON = 16
    MAIA = 17
    TRN = 18
    TPU = 19
    TPU_HOST = 20
    ASCEND = 21

@final
class DType:
    """A DLPack element type; ``str()`` gives the numpy/ml_dtypes name."""

    def __new__(cls, name_or_code: str | int, bits: int | None = None, lanes: int = 1) -> DType: ...
    @property
    def code(self) -> int: ...
    @property
    def bits(self) -> int: ...
    @property
    def lanes(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def itemsize(self) -> int | None: ...
    def __eq__(self, value: object, /) -> builtins.bool: ...
    def __hash__(self) -> int: ...

@final
class Device:
    """A device: ``type`` and ``id``; ``str()`` gives "cpu" or "cuda:1"."""

    def __new__(cls, kind: str | int, id: int | None = None) -> Device: ...
    @property
    def type(self) -> DeviceType | int: ...
    @property
    def id(self) -> int: ...
    def __dlpack_device__(self) -> tuple[DeviceType | int, int]: ...
    def __eq__(self, value: object, /) -> builtins.bool: ...
    def __hash__(self) -> int: ...

@final
class Tensor:
    """A DLPack tensor owned by dlbridge; every DLPack consumer accepts it, as often as asked."""

    __dlpack_c_exchange_api__: Final[Any]

    def __dlpack__(
        self,
        *,
        stream: Any | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: builtins.bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[DeviceType | int, int]: ...
    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]: ...
    def __deepcopy__(self, memo: Any) -> Tensor: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def strides(self) -> tuple[int, ...]: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def device(self) -> Device: ...
    @property
    def readonly(self) -> builtins.bool: ...
    @property
    def itemsize(self) -> int | None: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def byte_offset(self) -> int: ...
    @property
    def is_c_contiguous(self) -> builtins.bool: ...
    @property
    def is_f_contiguous(self) -> builtins.bool: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...
    if sys.version_info >= (3, 12):
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, buffer: memoryview, /) -> None: ...

def asdlpack(x: Any, /, *, device_id: int | None = None) -> Tensor: ...
def shared_empty(shape: int | Sequence[int], dtype: DType | str) -> Tensor: ...
def share(x: Any) -> Tensor: ...
def from_dlpack(
    x: Any,
    /,
    *,
    device: str | Device | tuple[int, int] | None = None,
    copy: builtins.bool | None = None,
    stream: Any | None = None,
    legacy_writable: builtins.bool = False,
) -> Tensor: ...

int8: Final[DType]
int16: Final[DType]
int32: Final[DType]
int64: Final[DType]
uint8: Final[DType]
uint16: Final[DType]
uint32: Final[DType]
uint64: Final[DType]
float16: Final[DType]
float32: Final[DType]
float64: Final[DType]
bfloat16: Final[DType]
complex32: Final[DType]
complex64: Final[DType]
complex128: Final[DType]
bool: Final[DType]
float8_e3m4: Final[DType]
float8_e4m3: Final[DType]
float8_e4m3b11fnuz: Final[DType]
float8_e4m3fn: Final[DType]
float8_e4m3fnuz: Final[DType]
float8_e5m2: Final[DType]
float8_e5m2fnuz: Final[DType]
float8_e8m0fnu: Final[DType]
float6_e2m3fn: Final[DType]
float6_e3m2fn: Final[DType]
float4_e2m1fn: Final[DType]
float4_e2m1fn_x2: Final[DType]
bcomplex32: Final[DType]
