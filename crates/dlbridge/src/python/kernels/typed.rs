//! Typed `#[pyfunction]` arguments: [`TensorRef`] (read) and [`TensorMut`] (write) state what a
//! kernel needs in their type (element type, shape, order, device; see [`crate::spec`]) and check
//! it once, at argument conversion, over a borrowed [`TensorView`] (no capsule, no copy). A
//! mismatch is a `TypeError` that PyO3 prefixes with the argument's name:
//! `expected float32 2-d C-contiguous cpu tensor, got float64 (3, 4) strides (1, 3) on cpu`, which
//! PyO3 tags with the note `while processing 'x'` (Python 3.11 and later); Rust code that converts
//! by hand ([`TensorView::typed`]) gets [`crate::Error::Mismatch`] (and [`crate::python::argument_error`]
//! words it the same way).
//!
//! ```no_run
//! use dlbridge::{TensorMut, TensorRef};
//! use dlbridge::spec::{C, Rank};
//! use pyo3::prelude::*;
//!
//! /// y += a * x, in place, for float32 vectors from numpy, torch, jax (x only: jax is read-only)...
//! #[pyfunction]
//! fn saxpy(a: f32, x: TensorRef<'_, f32, Rank<1>, C>, mut y: TensorMut<'_, f32, Rank<1>, C>) -> PyResult<()> {
//!     let x = x.as_slice()?;
//!     for (y, x) in y.as_slice_mut()?.iter_mut().zip(x.iter()) {
//!         *y += a * x;
//!     }
//!     Ok(())
//! }
//! ```
//!
//! Typed access needs no second statement of the type: `as_slice` exists only for compact orders
//! ([`C`](crate::spec::C), [`F`](crate::spec::F)) on host memory, `as_array` for host memory, and
//! `data_ptr` gives the typed element pointer for device memory. Each guard still takes its lease
//! in the borrow registry ([`crate::borrow`]), so `f(x, x)` with a `TensorRef` and a `TensorMut`
//! over the same array fails at the second guard instead of aliasing.
//!
//! The guards are `Send` (and `Sync`) for element types that are: a kernel takes its slices or
//! ndarray views first, then runs without the GIL (`py.detach(|| ...)`) or on rayon's threads.
//! The arguments themselves are not `Send`: they may hold a Python buffer view, whose release needs
//! the GIL, and their storage block belongs to the thread's pool.
//!
//! Python code run while a guard lives (a callback of the kernel, a method called through
//! [`TensorRef::object`], a finalizer, another thread while the kernel runs without the GIL)
//! cannot free the guarded memory of a borrowed argument: a borrowed view of a torch tensor keeps
//! the memory of its storage valid until the view is dropped, whatever is done to the tensor
//! (`x.set_()`, `x.resize_()`, `x.share_memory_()`; see `torch_bits::Keep`), and numpy refuses to
//! resize an array that is referenced. What the guards cannot stop: the caller's library freeing
//! memory where its own rules do not check: numpy's `a.resize(refcheck=False)` and
//! `a.__setstate__(...)` free an array's data under numpy's own views too, and an owned import
//! (a `ManagedTensor` argument, `from_dlpack`) holds what the producer's export holds: torch's
//! holds the tensor, whose storage `set_` replaces (as under `torch.from_dlpack` consumers, or
//! `torch.softmax` running while another thread replaces its input's storage). Kernels must not
//! reallocate their arguments, and callers must not while a kernel runs: the zero-copy contract
//! of every binding.
//!
//! ```compile_fail,E0277
//! fn send<T: Send>(_: T) {}
//! fn kernel(x: dlbridge::python::TensorRef<'_, f32>) {
//!     send(x); // E0277: a typed argument stays on the thread that holds the GIL
//! }
//! ```

use std::marker::PhantomData;

use pyo3::prelude::*;

use super::view::{TensorView, bump_version_in_aten, bump_version_in_python};
use crate::dtype::Element;
use crate::managed::ManagedTensor;
use crate::spec::{AnyOrder, AnyShape, Compact, Cpu, DeviceSpec, OrderSpec, ShapeSpec, SpecOf};

/// The requirement types, held without owning anything (`Send`/`Sync` follow the view alone).
type Stated<T, S, O, D> = PhantomData<fn() -> (T, S, O, D)>;

/// A read-only typed tensor argument: element type `T`, shape `S` ([`AnyShape`], `Rank<N>`, or a
/// tuple of `Dim<N>`/`Any`), order `O` ([`AnyOrder`], `C`, `F`) and device `D` ([`Cpu`], `Cuda`,
/// `AnyDevice`), checked at conversion.
///
/// It offers only typed access: `as_slice()` (compact orders on the CPU), `as_array()`, `get`,
/// `to_vec`, `data_ptr()`, with no type parameter to restate, and the metadata (`shape()`,
/// `strides()`, `dtype()`, ...). It does not deref to the untyped [`ManagedTensor`]: what the
/// compiler can see is refused at compile time. `as_slice()` without a compact order states no
/// memory order a slice could follow:
///
/// ```compile_fail,E0599
/// use dlbridge::TensorRef;
/// fn kernel(x: TensorRef<'_, f32>) {
///     let _ = x.as_slice(); // E0599: as_slice needs the order C or F in the type
/// }
/// ```
///
/// and a second element type cannot be asked of a typed argument:
///
/// ```compile_fail,E0107
/// use dlbridge::TensorRef;
/// use dlbridge::spec::{C, Rank};
/// fn kernel(x: TensorRef<'_, f32, Rank<1>, C>) {
///     let _ = x.as_slice::<f64>(); // E0107: as_slice takes no type parameter: the type says f32
/// }
/// ```
///
/// ```compile_fail,E0599
/// use dlbridge::TensorRef;
/// fn kernel(x: TensorRef<'_, f32>) {
///     let _ = x.as_slice::<f64>(); // E0599: no untyped as_slice::<U> behind a typed argument
/// }
/// ```
///
/// The untyped tensor stays one explicit call away ([`TensorRef::untyped`]).
#[repr(transparent)]
pub struct TensorRef<'a, T, S = AnyShape, O = AnyOrder, D = Cpu> {
    view: TensorView<'a>,
    _spec: Stated<T, S, O, D>,
}

/// A writable typed tensor argument: as [`TensorRef`], and the tensor must be writable (not
/// read-only, no two elements sharing memory); gives mutable slices and views
/// (`as_slice_mut()`, `as_array_mut()`, `data_ptr_mut()`), typed as the argument states. Like
/// [`TensorRef`], it does not deref to the untyped tensor ([`TensorMut::untyped`] gives it).
#[repr(transparent)]
pub struct TensorMut<'a, T, S = AnyShape, O = AnyOrder, D = Cpu> {
    view: TensorView<'a>,
    _spec: Stated<T, S, O, D>,
}

macro_rules! common {
    ($ty:ident, $spec:ident, $writes:literal) => {
        impl<'a, T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> $ty<'a, T, S, O, D> {
            /// Checks `view` against the stated requirements.
            #[inline]
            pub(crate) fn new(view: TensorView<'a>) -> crate::Result<Self> {
                view.check(&SpecOf::<T, S, O, D>::$spec)?;
                Ok(Self { view, _spec: PhantomData })
            }

            /// The requirements this argument states.
            pub const SPEC: crate::spec::Spec = SpecOf::<T, S, O, D>::$spec;

            /// The untyped borrowed view this argument was checked over (its own untyped
            /// accessors restate the element type: `view().as_slice::<T>()`).
            pub fn view(&self) -> &TensorView<'a> {
                &self.view
            }

            /// The untyped tensor (dtype, shape, strides, flags, ...; the untyped accessors
            /// `as_slice::<U>()` and the like check the element type again at run time).
            pub fn untyped(&self) -> &ManagedTensor {
                &self.view
            }

            /// The number of dimensions.
            pub fn ndim(&self) -> usize {
                self.view.ndim()
            }

            /// The extents, one per dimension.
            pub fn shape(&self) -> &[i64] {
                self.view.shape()
            }

            /// The strides in elements, one per dimension.
            pub fn strides(&self) -> &[i64] {
                self.view.strides()
            }

            /// The element type: always `T::DTYPE` (checked at conversion).
            pub fn dtype(&self) -> crate::DataType {
                self.view.dtype()
            }

            /// The device the memory is on.
            pub fn device(&self) -> crate::Device {
                self.view.device()
            }

            /// The number of elements.
            pub fn numel(&self) -> usize {
                self.view.numel()
            }

            /// Whether the producer marked the memory read-only (never for a [`TensorMut`]).
            pub fn is_read_only(&self) -> bool {
                self.view.is_read_only()
            }

            /// Whether the layout is compact row-major (size-1 axes ignored).
            pub fn is_c_contiguous(&self) -> bool {
                self.view.is_c_contiguous()
            }

            /// Whether the layout is compact column-major (size-1 axes ignored).
            pub fn is_f_contiguous(&self) -> bool {
                self.view.is_f_contiguous()
            }

            /// The caller's own object (to return it, or to call its methods).
            pub fn object<'py>(&self, py: Python<'py>) -> Borrowed<'a, 'py, PyAny> {
                self.view.object(py)
            }

            /// The caller's framework: return results as it ([`crate::python::Framework`]).
            pub fn framework(&self, py: Python<'_>) -> PyResult<crate::python::Framework> {
                self.view.framework(py)
            }

            /// The address of the first element, typed (host or device memory; never
            /// dereferenced by this call).
            pub fn data_ptr(&self) -> *const T {
                self.view.data_ptr().cast_const().cast()
            }

            /// A new tensor of `U` with this one's shape and device, in the caller's framework
            /// ([`crate::python::Framework::empty`]): fill it and return it.
            pub fn empty_like<U: Element>(&self, py: Python<'_>) -> PyResult<crate::python::Output<U>> {
                self.framework(py)?.empty_like::<U>(py, self.untyped())
            }
        }

        impl<'a, 'py, T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> FromPyObject<'a, 'py>
            for $ty<'a, T, S, O, D>
        {
            type Error = PyErr;

            #[inline(never)]
            fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
                // Out of line, one per argument type (a call in PyO3's argument glue): the view is
                // built, checked against the spec (a constant here) and wrapped where it is
                // returned.
                let spec = &SpecOf::<T, S, O, D>::$spec;
                if $writes {
                    return extract_for_write(obj, spec).map(|view| Self { view, _spec: PhantomData });
                }
                // SAFETY: a `Borrowed<'a, ..>` argument is alive for 'a.
                unsafe {
                    TensorView::borrow_checked_into(&obj, spec, |view| Self { view, _spec: PhantomData })
                }
            }
        }

        impl<'a, T: Element, S, O: Compact, D> $ty<'a, T, S, O, D>
        where
            S: ShapeSpec,
        {
            /// The elements in memory order (row-major for `C`, column-major for `F`), holding a
            /// shared lease ([`crate::Error::AlreadyBorrowed`] while a mutable guard over the same
            /// memory lives).
            pub fn as_slice(&self) -> crate::Result<crate::SliceRef<'_, T>>
            where
                D: HostSpec,
            {
                self.view.slice_in::<T>(O::ORDER)
            }
        }

        #[cfg(feature = "ndarray")]
        impl<'a, T: Element, S: ShapeSpec, O: OrderSpec, D: HostSpec> $ty<'a, T, S, O, D> {
            /// An `ndarray` view with the tensor's strides, holding a shared lease.
            pub fn as_array(&self) -> crate::Result<crate::ndarray::ArrayGuard<'_, T>> {
                self.view.as_array::<T>()
            }
        }

        impl<'a, T: Element, S: ShapeSpec, O: OrderSpec, D: HostSpec> $ty<'a, T, S, O, D> {
            /// The element at `index` (one index per dimension), any strides.
            pub fn get(&self, index: &[usize]) -> crate::Result<T> {
                self.view.get::<T>(index)
            }

            /// The elements in row-major order, copied into a `Vec`, any strides.
            pub fn to_vec(&self) -> crate::Result<Vec<T>> {
                self.view.to_vec::<T>()
            }
        }
    };
}

common!(TensorRef, READ, false);
common!(TensorMut, WRITE, true);

/// A typed argument's conversion for writing (`TensorMut`). torch's write rules are read first: their getters may run
/// Python (a torch function mode, a subclass), which may replace the tensor's storage. Nothing
/// between taking the view the kernel gets and handing it over runs Python: ATen's version bump
/// (exactly `torch.Tensor`, verified) runs none; where torch's Python function bumps instead, the
/// bump is made before that view is taken (a first view checks the requirements, so a mismatch
/// bumps nothing, and is dropped: the Python of the bump could free what it describes).
#[inline(never)]
fn extract_for_write<'a>(obj: Borrowed<'a, '_, PyAny>, spec: &crate::spec::Spec) -> PyResult<TensorView<'a>> {
    let torch = crate::python::import::type_info(&obj.get_type())?.torch;
    if let Some(state) = torch {
        // A tensor autograd would lose track of, then what torch refuses of an in-place write, are
        // refused here, at conversion (the argument named).
        state.refuse_untracked_read(&obj)?;
        state.refuse_write(&obj)?;
    }
    // SAFETY: a `Borrowed<'a, ..>` argument is alive for 'a.
    let view = unsafe { TensorView::borrow_checked(&obj, spec) }?;
    if torch.is_none() || bump_version_in_aten(&obj) {
        return Ok(view);
    }
    drop(view);
    bump_version_in_python(&obj)?;
    // SAFETY: as above.
    unsafe { TensorView::borrow_checked(&obj, spec) }
}

/// The typed forms of a view (see [`TensorRef`] and [`TensorMut`]); the view itself is in
/// `view.rs`, which knows nothing of them.
impl<'a> TensorView<'a> {
    /// This view with its requirements stated as types, checked once ([`crate::spec`]): a
    /// [`crate::python::TensorRef`], or [`crate::Error::Mismatch`] (a `TypeError` in Python) naming the
    /// first field that failed. For kernels that dispatch on the dtype at run time:
    ///
    /// ```no_run
    /// use dlbridge::python::TensorView;
    /// use dlbridge::spec::{C, Cpu, Rank};
    /// use dlbridge::DataType;
    /// use pyo3::prelude::*;
    /// #[pyfunction]
    /// fn total(x: TensorView<'_>) -> PyResult<f64> {
    ///     Ok(match x.dtype() {
    ///         DataType::FLOAT32 => x.typed::<f32, Rank<1>, C, Cpu>()?.as_slice()?.iter().map(|&v| v as f64).sum(),
    ///         _ => x.typed::<f64, Rank<1>, C, Cpu>()?.as_slice()?.iter().sum(),
    ///     })
    /// }
    /// ```
    pub fn typed<
        T: crate::Element,
        S: crate::spec::ShapeSpec,
        O: crate::spec::OrderSpec,
        D: crate::spec::DeviceSpec,
    >(
        self,
    ) -> crate::Result<TensorRef<'a, T, S, O, D>> {
        TensorRef::new(self)
    }

    /// [`TensorView::typed`] for writing: the tensor must also be writable (not read-only, no
    /// overlapping elements).
    pub fn typed_mut<
        T: crate::Element,
        S: crate::spec::ShapeSpec,
        O: crate::spec::OrderSpec,
        D: crate::spec::DeviceSpec,
    >(
        self,
    ) -> crate::Result<TensorMut<'a, T, S, O, D>> {
        // The stated requirements first: a mismatch bumps nothing.
        self.check(&TensorMut::<'a, T, S, O, D>::SPEC)?;
        self.prepare_producer_write()?;
        TensorMut::new(self)
    }
}

/// Device requirements under which the memory is host-accessible (typed slices and views).
pub trait HostSpec: DeviceSpec {}
impl HostSpec for Cpu {}

impl<'a, T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> TensorMut<'a, T, S, O, D> {
    /// The address of the first element, typed and mutable (host or device memory; never
    /// dereferenced by this call).
    pub fn data_ptr_mut(&mut self) -> *mut T {
        self.view.data_ptr().cast()
    }
}

impl<'a, T: Element, S: ShapeSpec, O: Compact, D: HostSpec> TensorMut<'a, T, S, O, D> {
    /// The elements in memory order, mutably, holding an exclusive lease
    /// ([`crate::Error::AlreadyBorrowed`] while any other guard over the same memory lives).
    pub fn as_slice_mut(&mut self) -> crate::Result<crate::SliceMut<'_, T>> {
        self.view.tensor_mut().slice_mut_in::<T>(O::ORDER)
    }
}

#[cfg(feature = "ndarray")]
impl<'a, T: Element, S: ShapeSpec, O: OrderSpec, D: HostSpec> TensorMut<'a, T, S, O, D> {
    /// A mutable `ndarray` view with the tensor's strides, holding an exclusive lease.
    pub fn as_array_mut(&mut self) -> crate::Result<crate::ndarray::ArrayGuardMut<'_, T>> {
        self.view.tensor_mut().as_array_mut::<T>()
    }
}

/// A list-of-tensors argument (a kernel's `Tensor[]` parameter): a Python `list` or `tuple` whose
/// every item is checked as a [`TensorRef`] of the same requirements at conversion (a mismatch
/// names the item: `item 2: expected float32 ...`, after PyO3's `argument 'xs':`).
///
/// The items are held for the call: a list is copied into a tuple first (its items' references
/// taken), so Python code run while the kernel runs cannot free an item by changing the list.
/// Items are reached by reference ([`get`](Self::get), [`iter`](Self::iter), `for x in &xs`),
/// each borrowed no longer than the list (no `Index`: its output could not say so):
///
/// ```compile_fail,E0505
/// use dlbridge::python::TensorList;
/// use pyo3::prelude::*;
/// fn first<'a, 'py>(py: Python<'py>, xs: TensorList<'a, f32>) -> Borrowed<'a, 'py, PyAny> {
///     let o = xs.get(0).unwrap().object(py);
///     drop(xs); // E0505: the item is borrowed from the list, which holds its object
///     o
/// }
/// ```
///
/// ```no_run
/// use dlbridge::python::TensorList;
/// use dlbridge::spec::{C, Rank};
/// use pyo3::prelude::*;
///
/// /// The sum of every element of float32 vectors.
/// #[pyfunction]
/// fn total(xs: TensorList<'_, f32, Rank<1>, C>) -> PyResult<f32> {
///     let mut t = 0.0;
///     for x in &xs {
///         t += x.as_slice()?.iter().sum::<f32>();
///     }
///     Ok(t)
/// }
/// ```
pub struct TensorList<'a, T, S = AnyShape, O = AnyOrder, D = Cpu> {
    /// The items' views: declared first, so dropped before the tuple that keeps their objects.
    items: Vec<TensorRef<'a, T, S, O, D>>,
    /// The items' objects, held (a strong reference to a tuple of them).
    _held: Py<pyo3::types::PyTuple>,
}

impl<'a, T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> TensorList<'a, T, S, O, D> {
    /// The number of items.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Item `i`, borrowed for as long as the list.
    pub fn get(&self, i: usize) -> Option<&TensorRef<'_, T, S, O, D>> {
        self.items.get(i).map(Self::shorten)
    }

    /// The items in order, each borrowed for as long as the list.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &TensorRef<'_, T, S, O, D>> {
        self.items.iter().map(Self::shorten)
    }

    /// An item's view borrowed no longer than the list: its object is held by the list, not for
    /// `'a` (covariance shortens the lifetime).
    fn shorten<'s>(item: &'s TensorRef<'a, T, S, O, D>) -> &'s TensorRef<'s, T, S, O, D> {
        item
    }
}

impl<'s, 'a, T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> IntoIterator
    for &'s TensorList<'a, T, S, O, D>
{
    type Item = &'s TensorRef<'s, T, S, O, D>;
    type IntoIter = std::iter::Map<
        std::slice::Iter<'s, TensorRef<'a, T, S, O, D>>,
        fn(&'s TensorRef<'a, T, S, O, D>) -> &'s TensorRef<'s, T, S, O, D>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter().map(TensorList::<'a, T, S, O, D>::shorten)
    }
}

impl<'a, 'py, T: Element, S: ShapeSpec, O: OrderSpec, D: DeviceSpec> FromPyObject<'a, 'py>
    for TensorList<'a, T, S, O, D>
{
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        use pyo3::types::{PyList, PyTuple};
        let py = obj.py();
        let held: Bound<'py, PyTuple> = if let Ok(t) = obj.cast::<PyTuple>() {
            t.to_owned()
        } else if let Ok(l) = obj.cast::<PyList>() {
            l.to_tuple()
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "expected a list or tuple of tensors, got {}",
                obj.get_type().name()?
            )));
        };
        let spec = &SpecOf::<T, S, O, D>::READ;
        let mut items = Vec::with_capacity(held.len());
        for (i, item) in held.iter().enumerate() {
            // SAFETY: `item` is held by `held`, a tuple (immutable) kept in the result after the
            // views, which are dropped first; no view is handed out for longer than the list
            // (`shorten`).
            let view = unsafe { TensorView::borrow_checked(&item, spec) }.map_err(|e| {
                let message = format!("item {i}: {}", e.value(py));
                PyErr::from_type(e.get_type(py), message)
            })?;
            items.push(TensorRef { view, _spec: PhantomData });
        }
        Ok(Self { items, _held: held.unbind() })
    }
}
