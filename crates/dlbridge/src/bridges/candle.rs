//! `candle` bridge (feature `candle`, candle-core without its CUDA backend): a CPU candle `Tensor`
//! exported as a **copy** of its elements, and a tensor imported into candle with one copy.
//!
//! Why export copies: candle writes into a tensor's storage through a shared `&Tensor`
//! (`one_set`, `const_set`, `zero_set`, `slice_set`, `Var::set`, in-place custom ops), under its own
//! lock and at any time. A zero-copy export would hand out a `&[T]` (or a raw read) of memory candle
//! may change while it lives, which Rust forbids (undefined behaviour that Miri reports, even for a
//! read after the write, because candle's `&mut` invalidates the pointer taken before it), and which
//! a read on another thread would make a data race. So [`ManagedTensor::from_candle`] copies the
//! tensor's elements in row-major order while it holds candle's read lock (candle writes only under
//! its write lock), into a new 256-byte-aligned buffer that the export owns alone: no memory is
//! shared with candle afterwards, whatever either side does. The copy is C-contiguous (a transposed,
//! narrowed or broadcast candle tensor arrives as its values, not its strides) and writable; writing
//! it does not change the candle tensor. The cost is one pass over the elements (one `memcpy` when
//! the candle layout is already C-contiguous).
//!
//! Why import copies: a candle CPU tensor owns its storage as a `Vec<T>` (candle has no storage
//! over foreign memory), so the elements are read once, in row-major order whatever the strides,
//! into a new `Vec` that candle then takes without a second copy. Candle's CUDA storage needs
//! candle's `cuda` feature, which compiles CUDA kernels with `nvcc` at build time; this crate does
//! not enable it (it must build without a CUDA installation), so CUDA candle tensors are refused;
//! the [`super::cudarc`] bridge moves CUDA memory.
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use dlbridge::ManagedTensor;
//! let c = Tensor::arange(0f32, 6., &Device::Cpu).unwrap().reshape((2, 3)).unwrap().t().unwrap();
//! let t = ManagedTensor::from_candle(&c).unwrap();                       // one copy, in C order
//! assert_eq!((t.shape(), t.strides()), (&[3i64, 2][..], &[2i64, 1][..]));
//! assert_eq!(t.as_slice::<f32>().unwrap(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
//! c.zero_set().unwrap();                           // candle writes its own storage...
//! assert_eq!(t.get::<f32>(&[0, 1]).unwrap(), 3.0); // ...the export is not affected
//! let back = t.to_candle().unwrap();                                      // one copy
//! assert_eq!(back.to_vec2::<f32>().unwrap(), [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]);
//! ```

use candle_core::{CpuStorage, Device, Layout, Storage, Tensor, WithDType};

use crate::dtype::{DataType, Element};
use crate::error::{Error, Result};
use crate::export::AlignedBuffer;
use crate::managed::ManagedTensor;

/// Copies the elements `layout` selects from `storage` into `out`, in row-major order, converting
/// each with `f`. `out` has exactly the layout's element count. Safe code: every index is checked.
fn gather<S: Copy, T>(storage: &[S], layout: &Layout, out: &mut [T], f: impl Fn(S) -> T) {
    debug_assert_eq!(out.len(), layout.shape().elem_count());
    if let Some((start, end)) = layout.contiguous_offsets() {
        for (o, &s) in out.iter_mut().zip(&storage[start..end]) {
            *o = f(s);
        }
        return;
    }
    let (dims, strides) = (layout.dims(), layout.stride());
    if out.is_empty() {
        return;
    }
    // An odometer over the multi-index; `at` is the storage index of the current element.
    let mut index = vec![0usize; dims.len()];
    let mut at = layout.start_offset();
    for o in out.iter_mut() {
        *o = f(storage[at]);
        for ax in (0..dims.len()).rev() {
            index[ax] += 1;
            if index[ax] < dims[ax] {
                at += strides[ax];
                break;
            }
            // This axis wraps (candle's strides and offset keep `at` inside the storage).
            at -= strides[ax] * (dims[ax] - 1);
            index[ax] = 0;
        }
    }
}

/// The copy of a candle tensor of element type `T` (a Rust type with a DLPack dtype).
fn copy<T: Element>(v: &[T], layout: &Layout) -> Result<ManagedTensor> {
    let mut buf = AlignedBuffer::<T>::try_zeroed(layout.shape().elem_count())?;
    gather(v, layout, &mut buf, |x| x);
    ManagedTensor::from_host(buf, layout.dims())
}

/// [`copy`] for candle's one-byte float8 dtypes, which have no Rust type here: the elements' bytes
/// (`to_byte` of each), tagged with the DLPack dtype.
fn copy_bytes<S: Copy>(
    v: &[S],
    layout: &Layout,
    dtype: DataType,
    to_byte: impl Fn(S) -> u8,
) -> Result<ManagedTensor> {
    let mut buf = AlignedBuffer::<u8>::try_zeroed(layout.shape().elem_count())?;
    gather(v, layout, &mut buf, to_byte);
    ManagedTensor::from_host_bytes(buf, dtype, layout.dims(), None, 0)
}

impl ManagedTensor {
    /// Exports a CPU candle tensor as a copy of its elements: a new C-contiguous, writable,
    /// 256-byte-aligned tensor of the candle tensor's shape and dtype, owning its memory alone
    /// (candle may write its own storage through any `&Tensor` at any time, so sharing it would be
    /// unsound; see the module docs). The copy is made under candle's read lock. float8 (e4m3,
    /// e8m0) exports as DLPack's float8 dtypes; candle's float6/float4 dtypes are refused (candle
    /// keeps them as placeholder bytes whose packing it does not specify), as are CUDA and Metal
    /// tensors.
    pub fn from_candle(t: &Tensor) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let refuse = |what: String| Error::Incompatible {
            expected: "a CPU candle tensor of dtype u8, u32, i16, i32, i64, bf16, f16, f32, f64, f8e4m3 \
                       or f8e8m0"
                .into(),
            found: what,
        };
        let Storage::Cpu(cpu) = &*storage else {
            return Err(refuse(format!("a candle tensor on {:?}", t.device().location())));
        };
        // The read guard `storage` lives to the end of this function: candle cannot write while
        // the elements are copied.
        match cpu {
            CpuStorage::U8(v) => copy(v, layout),
            CpuStorage::U32(v) => copy(v, layout),
            CpuStorage::I16(v) => copy(v, layout),
            CpuStorage::I32(v) => copy(v, layout),
            CpuStorage::I64(v) => copy(v, layout),
            CpuStorage::BF16(v) => copy(v, layout),
            CpuStorage::F16(v) => copy(v, layout),
            CpuStorage::F32(v) => copy(v, layout),
            CpuStorage::F64(v) => copy(v, layout),
            // float8::F8E4M3 is OCP E4M3 (DLPack float8_e4m3fn); candle keeps F8E8M0 as its bytes.
            CpuStorage::F8E4M3(v) => copy_bytes(v, layout, DataType::FLOAT8_E4M3FN, |x| x.to_bits()),
            CpuStorage::F8E8M0(v) => copy_bytes(v, layout, DataType::FLOAT8_E8M0FNU, |x| x),
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
