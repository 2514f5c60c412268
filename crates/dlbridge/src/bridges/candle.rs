//! `candle` bridge (feature `candle`, candle-core without its CUDA backend): a CPU candle `Tensor`
//! exported without copying, with its layout's shape, strides and start offset; a tensor imported
//! into candle with one copy.
//!
//! Why one copy into candle: a candle CPU tensor owns its storage as a `Vec<T>` (candle has no
//! storage over foreign memory), so the elements are read once, in row-major order whatever the
//! strides, into a new `Vec` that candle then takes without a second copy. Candle's CUDA storage
//! needs candle's `cuda` feature, which compiles CUDA kernels with `nvcc` at build time; this
//! crate does not enable it (it must build without a CUDA installation), so CUDA candle tensors
//! are refused; the [`super::cudarc`] bridge moves CUDA memory.
//!
//! Export is read-only: candle reads its storage under its own lock and never expects another
//! writer, so consumers get the memory read-only (torch ignores that flag; do not write there).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use dlbridge::ManagedTensor;
//! let c = Tensor::arange(0f32, 6., &Device::Cpu).unwrap().reshape((2, 3)).unwrap().t().unwrap();
//! let t = ManagedTensor::from_candle(&c).unwrap();
//! assert_eq!((t.shape(), t.strides()), (&[3i64, 2][..], &[1i64, 3][..])); // the transpose, no copy
//! assert_eq!(t.to_vec::<f32>().unwrap(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
//! let back = t.to_candle().unwrap();                                      // one copy
//! assert_eq!(back.to_vec2::<f32>().unwrap(), c.to_vec2::<f32>().unwrap());
//! ```

use candle_core::{CpuStorage, Device, Storage, Tensor, WithDType};

use crate::dtype::{DataType, Element};
use crate::error::{Error, Result};
use crate::export::HostBuffer;
use crate::managed::ManagedTensor;

/// A candle tensor as the owner of its exported storage.
struct CandleStorage<T> {
    first: *mut T,
    len: usize,
    _tensor: Tensor,
}

// SAFETY: the pointer is into the storage the `Tensor` (an `Arc`) keeps alive; the handle is only
// kept, never used, so sending it is sending the `Tensor`, which is `Send`.
unsafe impl<T> Send for CandleStorage<T> {}

// SAFETY: `first` is the first of `len` elements of a candle CPU storage `Vec<T>`, which candle
// never reallocates while a `Tensor` over it lives (its in-place operations write into the same
// `Vec`); the `Tensor` clone kept here keeps it alive. The export is read-only (`is_read_only`),
// so consumers only read, as candle's own readers do.
unsafe impl<T: Element> HostBuffer for CandleStorage<T> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        self.first
    }
    fn elem_count(&self) -> usize {
        self.len
    }
    fn is_read_only(&self) -> bool {
        true
    }
}

fn export<T: Element>(v: &[T], t: &Tensor) -> Result<ManagedTensor> {
    let layout = t.layout();
    let strides: Vec<isize> = layout.stride().iter().map(|&s| s as isize).collect();
    let buf = CandleStorage { first: v.as_ptr().cast_mut(), len: v.len(), _tensor: t.clone() };
    ManagedTensor::from_host_strided(buf, layout.dims(), &strides, layout.start_offset())
}

/// [`export`] for candle's one-byte float8 dtypes, which have no Rust type here: the storage's
/// bytes, tagged with the DLPack dtype.
fn export_bytes(first: *const u8, len: usize, dtype: DataType, t: &Tensor) -> Result<ManagedTensor> {
    let layout = t.layout();
    let strides: Vec<isize> = layout.stride().iter().map(|&s| s as isize).collect();
    let buf = CandleStorage { first: first.cast_mut(), len, _tensor: t.clone() };
    ManagedTensor::from_host_bytes(buf, dtype, layout.dims(), Some(&strides), layout.start_offset())
}

impl ManagedTensor {
    /// Exports a CPU candle tensor without copying: the storage candle holds, with the tensor's
    /// shape, strides and start offset (a transposed, narrowed or broadcast candle tensor stays
    /// that view). The tensor is read-only and keeps a clone of the candle tensor alive. float8
    /// (e4m3, e8m0) exports as DLPack's float8 dtypes; candle's float6/float4 dtypes are refused
    /// (candle keeps them as placeholder bytes whose packing it does not specify), as are CUDA
    /// and Metal tensors.
    pub fn from_candle(t: &Tensor) -> Result<Self> {
        let (storage, _) = t.storage_and_layout();
        let refuse = |what: String| Error::Incompatible {
            expected: "a CPU candle tensor of dtype u8, u32, i16, i32, i64, bf16, f16, f32, f64, f8e4m3 \
                       or f8e8m0"
                .into(),
            found: what,
        };
        let Storage::Cpu(cpu) = &*storage else {
            return Err(refuse(format!("a candle tensor on {:?}", t.device().location())));
        };
        // The pointer is taken under candle's read lock; the storage `Vec` stays where it is after
        // the lock is released (see `CandleStorage`).
        match cpu {
            CpuStorage::U8(v) => export(v, t),
            CpuStorage::U32(v) => export(v, t),
            CpuStorage::I16(v) => export(v, t),
            CpuStorage::I32(v) => export(v, t),
            CpuStorage::I64(v) => export(v, t),
            CpuStorage::BF16(v) => export(v, t),
            CpuStorage::F16(v) => export(v, t),
            CpuStorage::F32(v) => export(v, t),
            CpuStorage::F64(v) => export(v, t),
            // float8::F8E4M3 is a transparent u8 (OCP E4M3, DLPack float8_e4m3fn); candle keeps
            // F8E8M0 as its bytes.
            CpuStorage::F8E4M3(v) => export_bytes(v.as_ptr().cast(), v.len(), DataType::FLOAT8_E4M3FN, t),
            CpuStorage::F8E8M0(v) => export_bytes(v.as_ptr(), v.len(), DataType::FLOAT8_E8M0FNU, t),
            _ => Err(refuse(format!("a CPU candle tensor of dtype {:?}", t.dtype()))),
        }
    }

    /// A CPU candle tensor with this host tensor's elements, copied once (row-major, any strides;
    /// the read holds a shared lease). Supported dtypes: those candle has (uint8, uint32, int16,
    /// int32, int64, bfloat16, float16, float32, float64).
    pub fn to_candle(&self) -> Result<Tensor> {
        fn copy<T: Element + WithDType>(t: &ManagedTensor) -> Result<Tensor> {
            let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
            Tensor::from_vec(t.to_vec::<T>()?, shape, &Device::Cpu).map_err(|e| Error::Incompatible {
                expected: "a tensor candle can hold".into(),
                found: e.to_string(),
            })
        }
        match self.dtype() {
            DataType::UINT8 => copy::<u8>(self),
            DataType::UINT32 => copy::<u32>(self),
            DataType::INT16 => copy::<i16>(self),
            DataType::INT32 => copy::<i32>(self),
            DataType::INT64 => copy::<i64>(self),
            DataType::BFLOAT16 => copy::<half::bf16>(self),
            DataType::FLOAT16 => copy::<half::f16>(self),
            DataType::FLOAT32 => copy::<f32>(self),
            DataType::FLOAT64 => copy::<f64>(self),
            _ => Err(Error::Incompatible {
                expected: "a host tensor of a dtype candle has (uint8, uint32, int16, int32, int64, \
                           bfloat16, float16, float32, float64)"
                    .into(),
                found: self.describe(),
            }),
        }
    }
}
