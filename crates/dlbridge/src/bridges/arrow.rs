//! `arrow` bridge (feature `arrow`, over `arrow-array`/`arrow-buffer`/`arrow-schema`, not the whole
//! `arrow` crate): a 1-d tensor as a `PrimitiveArray<T>` and back, an n-d tensor as a
//! `FixedSizeListArray` (with the `arrow.fixed_shape_tensor` canonical extension type on its field)
//! and back, all without copying in either direction.
//!
//! Into arrow, the arrow `Buffer` owns the tensor (its deleter runs when the last arrow array
//! over it drops) and holds a shared lease on its memory (see [`crate::borrow`]), so no mutable
//! slice or view of the same memory can be made through dlbridge while arrow reads it. Out of
//! arrow, the tensor holds a clone of the arrow buffer and is read-only: arrow buffers are
//! immutable and may be shared by other arrays.
//!
//! Arrays with nulls are refused (a tensor has no validity bitmap), as are boolean arrays (arrow
//! packs them to bits; use `uint8`) and non-contiguous tensors (arrow values are contiguous;
//! [`ManagedTensor::to_contiguous`] first).
//!
//! ```
//! use arrow_array::Array;
//! use arrow_array::types::Float32Type;
//! use dlbridge::ManagedTensor;
//! let t = ManagedTensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
//! let ptr = t.data_ptr();
//! let a = t.into_arrow::<Float32Type>().unwrap();            // the tensor now lives in arrow
//! assert_eq!(a.values().as_ptr().cast(), ptr.cast_const());
//! let back = ManagedTensor::from_arrow(&a).unwrap();          // and back, still the same memory
//! assert_eq!((back.data_ptr(), back.is_read_only()), (ptr, true));
//! assert_eq!(back.as_slice::<f32>().unwrap(), &[1.0, 2.0, 3.0]);
//!
//! // An n-d tensor as a list array of the fixed_shape_tensor extension type.
//! let t = ManagedTensor::from_vec((0..12).collect::<Vec<i64>>(), &[2, 3, 2]).unwrap();
//! let (field, list) = t.into_arrow_tensor::<arrow_array::types::Int64Type>().unwrap();
//! assert_eq!((list.len(), list.value_length()), (2, 6));
//! assert_eq!(field.metadata()["ARROW:extension:metadata"], r#"{"shape":[3,2]}"#);
//! let back = ManagedTensor::from_arrow_tensor::<arrow_array::types::Int64Type>(&list, Some(&field)).unwrap();
//! assert_eq!((back.shape(), back.get::<i64>(&[1, 2, 1]).unwrap()), (&[2i64, 3, 2][..], 11));
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::types::ArrowPrimitiveType;
use arrow_array::{Array, FixedSizeListArray, PrimitiveArray};
use arrow_buffer::{Buffer, ScalarBuffer};
use arrow_schema::Field;

use crate::borrow::Lease;
use crate::dtype::Element;
use crate::error::{Error, Result, tuple};
use crate::export::HostBuffer;
use crate::managed::ManagedTensor;

/// The extension name of arrow's canonical fixed-shape tensor type.
pub const FIXED_SHAPE_TENSOR: &str = "arrow.fixed_shape_tensor";
const EXTENSION_NAME: &str = "ARROW:extension:name";
const EXTENSION_METADATA: &str = "ARROW:extension:metadata";

/// The owner of an arrow buffer made from a tensor: the tensor (deleted when arrow drops the
/// buffer) and the shared lease on its memory, released first.
struct TensorAllocation {
    _lease: Lease,
    _tensor: ManagedTensor,
}

// The tensor is only kept alive here (never touched again until dropped), so a panic elsewhere
// cannot leave it observed in a broken state.
impl std::panic::RefUnwindSafe for TensorAllocation {}

fn no_nulls(what: &str, array: &dyn Array) -> Result<()> {
    match array.null_count() {
        0 => Ok(()),
        n => Err(Error::Incompatible {
            expected: format!("an arrow array without nulls ({what}; a tensor has no validity bitmap)"),
            found: format!("null_count {n} of {} values", array.len()),
        }),
    }
}

impl ManagedTensor {
    /// The tensor's elements, in row-major order, as arrow values: the tensor moves into the
    /// buffer's owner with a shared lease.
    fn into_arrow_values<A: ArrowPrimitiveType>(self) -> Result<PrimitiveArray<A>>
    where
        A::Native: Element,
    {
        if !self.is_c_contiguous() {
            return Err(self.refuse_view::<A::Native>(false, " in C order (arrow values are contiguous)"));
        }
        // The one typed-view path: host, dtype, alignment (arrow checks it too, by panicking), lease.
        let (first, lease) = self.strided_view::<A::Native>(false)?;
        let len = self.numel();
        let bytes = len * size_of::<A::Native>();
        let owner = Arc::new(TensorAllocation { _lease: lease, _tensor: self });
        // SAFETY: `first` is the first of `len` contiguous, aligned elements of dtype
        // `A::Native` in host memory (checked above; dangling and aligned when empty), which the
        // tensor inside `owner` keeps alive and the shared lease keeps dlbridge's mutable access
        // away from for as long as arrow holds the buffer; nothing writes it through arrow.
        let buffer = unsafe { Buffer::from_custom_allocation(first.cast(), bytes, owner) };
        Ok(PrimitiveArray::new(ScalarBuffer::new(buffer, 0, len), None))
    }

    /// A 1-d host tensor of dtype `A::Native`, contiguous, as an arrow `PrimitiveArray` without
    /// copying. The array's buffer owns the tensor; read-only tensors are fine (arrow never writes).
    pub fn into_arrow<A: ArrowPrimitiveType>(self) -> Result<PrimitiveArray<A>>
    where
        A::Native: Element,
    {
        super::dims::<1>(&self, "an arrow array")?;
        self.into_arrow_values()
    }

    /// An arrow `PrimitiveArray` as a read-only 1-d tensor without copying (the tensor holds a
    /// clone of the array's value buffer). Arrays with nulls are refused.
    pub fn from_arrow<A: ArrowPrimitiveType>(array: &PrimitiveArray<A>) -> Result<Self>
    where
        A::Native: Element,
    {
        no_nulls("PrimitiveArray", array)?;
        let values = array.values().clone();
        let n = values.len();
        ManagedTensor::from_host(ArrowValues(values), &[n])
    }

    /// A C-contiguous host tensor of 2 or more dimensions `(n, d1, ..., dk)` as `n` fixed-size
    /// lists of `d1 * ... * dk` values, without copying, with the field that carries the
    /// `arrow.fixed_shape_tensor` extension type (`{"shape":[d1,...,dk]}`). Empty tensors keep
    /// their shape: `(2, 0, 3)` is 2 lists of 0 values with cell shape `[0,3]`.
    pub fn into_arrow_tensor<A: ArrowPrimitiveType>(self) -> Result<(Field, FixedSizeListArray)>
    where
        A::Native: Element,
    {
        let dims: Vec<usize> = self.shape().iter().map(|&d| d as usize).collect();
        // Elements per list; 0 if any cell extent is 0 (the others may then be anything).
        let cell = dims.get(1..).unwrap_or_default();
        let size =
            if cell.contains(&0) { Some(0) } else { cell.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) };
        let Some(size) = size.and_then(|s| i32::try_from(s).ok()).filter(|_| dims.len() >= 2) else {
            return Err(Error::Incompatible {
                expected: "a tensor of 2 or more dimensions whose rows have at most 2^31-1 elements \
                           (an arrow FixedSizeListArray)"
                    .into(),
                found: self.describe(),
            });
        };
        let values = self.into_arrow_values::<A>()?;
        let item = Arc::new(Field::new("item", A::DATA_TYPE, false));
        // The number of lists is stated, not inferred: with lists of 0 values (a 0 among the cell
        // extents) `try_new` would count values / size as 0 lists, losing the first extent.
        let list = FixedSizeListArray::try_new_with_length(item, size, Arc::new(values), None, dims[0])
            .map_err(|e| Error::Incompatible {
                expected: "a valid FixedSizeListArray".into(),
                found: e.to_string(),
            })?;
        let shape = dims[1..].iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
        let meta = HashMap::from([
            (EXTENSION_NAME.to_string(), FIXED_SHAPE_TENSOR.to_string()),
            (EXTENSION_METADATA.to_string(), format!("{{\"shape\":[{shape}]}}")),
        ]);
        let field = Field::new("tensor", list.data_type().clone(), false).with_metadata(meta);
        Ok((field, list))
    }

    /// A `FixedSizeListArray` of `n` lists of `size` values of type `A` as a read-only tensor,
    /// without copying: shape `(n, size)`, or `(n, d1, ..., dk)` when `field` carries the
    /// `arrow.fixed_shape_tensor` extension type (its `permutation`, if any, becomes strides).
    /// Nulls, in the lists or their values, are refused.
    pub fn from_arrow_tensor<A: ArrowPrimitiveType>(
        array: &FixedSizeListArray,
        field: Option<&Field>,
    ) -> Result<Self>
    where
        A::Native: Element,
    {
        no_nulls("FixedSizeListArray", array)?;
        let values = array.values();
        let Some(values) = values.as_any().downcast_ref::<PrimitiveArray<A>>() else {
            return Err(Error::Incompatible {
                expected: format!("FixedSizeList values of type {}", A::DATA_TYPE),
                found: format!("values of type {}", values.data_type()),
            });
        };
        no_nulls("FixedSizeListArray values", values)?;
        let (n, size) = (array.len(), array.value_length() as usize);
        let mut shape = vec![n, size];
        let mut strides = vec![size as isize, 1];
        if let Some((cell, perm)) = field.map(fixed_shape).transpose()?.flatten() {
            if cell.iter().product::<usize>() != size {
                return Err(Error::Incompatible {
                    expected: format!("an extension shape of {size} elements per list"),
                    found: format!("{FIXED_SHAPE_TENSOR} shape {}", tuple(&cell)),
                });
            }
            // The lists hold each cell in row-major order over the permuted (physical) shape;
            // logical axis perm[j] has the physical stride of position j.
            let physical: Vec<usize> = perm.iter().map(|&p| cell[p]).collect();
            let mut cell_strides = vec![0isize; cell.len()];
            let mut s = 1isize;
            for j in (0..physical.len()).rev() {
                cell_strides[perm[j]] = s;
                s *= physical[j] as isize;
            }
            shape = std::iter::once(n).chain(cell).collect();
            strides = std::iter::once(size as isize).chain(cell_strides).collect();
        }
        let buf = values.values().slice(0, n * size);
        ManagedTensor::from_host_strided(ArrowValues(buf), &shape, &strides, 0)
    }
}

/// The cell shape and permutation of an `arrow.fixed_shape_tensor` field, `None` for a field of
/// another (or no) extension type.
#[allow(clippy::type_complexity)]
fn fixed_shape(field: &Field) -> Result<Option<(Vec<usize>, Vec<usize>)>> {
    let m = field.metadata();
    if m.get(EXTENSION_NAME).map(String::as_str) != Some(FIXED_SHAPE_TENSOR) {
        return Ok(None);
    }
    let json = m.get(EXTENSION_METADATA).map(String::as_str).unwrap_or("");
    let bad = |why: &str| Error::Incompatible {
        expected: format!("{FIXED_SHAPE_TENSOR} metadata with {why}"),
        found: format!("{EXTENSION_METADATA} {json:?}"),
    };
    let shape = int_list(json, "shape").ok_or_else(|| bad("a \"shape\" list of non-negative integers"))?;
    let perm = match int_list(json, "permutation") {
        None if json.contains("\"permutation\"") => return Err(bad("a \"permutation\" list of integers")),
        None => (0..shape.len()).collect(),
        Some(p) => p,
    };
    let mut seen = vec![false; shape.len()];
    let valid = perm.len() == shape.len()
        && perm.iter().all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
    if !valid {
        return Err(bad("a \"permutation\" of the shape's axes"));
    }
    Ok(Some((shape, perm)))
}

/// The list of integers under `"key": [...]` in a flat JSON object (what the fixed-shape tensor
/// metadata is: `shape`, `permutation`, `dim_names`).
fn int_list(json: &str, key: &str) -> Option<Vec<usize>> {
    let at = json.find(&format!("\"{key}\""))? + key.len() + 2;
    let rest = json[at..].trim_start().strip_prefix(':')?.trim_start().strip_prefix('[')?;
    let body = &rest[..rest.find(']')?];
    if body.trim().is_empty() {
        return Some(vec![]);
    }
    body.split(',').map(|x| x.trim().parse().ok()).collect()
}

/// An arrow value buffer as the owner of an exported (read-only) tensor.
struct ArrowValues<T: arrow_buffer::ArrowNativeType>(ScalarBuffer<T>);

// SAFETY: a `ScalarBuffer<T>` is `len` aligned values of `T` (arrow checks the alignment when it is
// made) in an immutable, reference-counted allocation that this clone keeps alive and in place;
// the tensor is read-only, so the memory is only ever read, as every other arrow holder does.
unsafe impl<T: arrow_buffer::ArrowNativeType + Element> HostBuffer for ArrowValues<T> {
    type Elem = T;
    fn as_mut_ptr(&mut self) -> *mut T {
        self.0.as_ptr().cast_mut()
    }
    fn elem_count(&self) -> usize {
        self.0.len()
    }
    fn is_read_only(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_lists_parse() {
        assert_eq!(int_list(r#"{"shape":[2, 3]}"#, "shape"), Some(vec![2, 3]));
        assert_eq!(int_list(r#"{"shape": [], "dim_names": ["a"]}"#, "shape"), Some(vec![]));
        assert_eq!(int_list(r#"{"permutation":[1,0],"shape":[4,5]}"#, "permutation"), Some(vec![1, 0]));
        assert_eq!(int_list(r#"{"shape":[2,-1]}"#, "shape"), None);
        assert_eq!(int_list(r#"{"dim_names":["x"]}"#, "shape"), None);
    }
}
