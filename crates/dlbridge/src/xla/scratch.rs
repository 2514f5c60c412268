//! Scratch memory for one call ([`Call::scratch`](super::Call::scratch),
//! [`Call::device_scratch`](super::Call::device_scratch)).
//!
//! XLA's CPU runtime implements `XLA_FFI_DeviceMemory_Allocate` for GPU contexts only (on the
//! CPU it answers "XLA FFI GPU context is not available"), so a CPU handler's scratch is a Rust
//! allocation, freed when the call returns; a CUDA handler's device scratch comes from XLA's
//! allocator and goes back to it when the call returns.

use std::alloc::Layout;
use std::cell::RefCell;
use std::ptr::NonNull;

use std::ffi::c_void;

use super::api::{Api, FfiError, Result};
use crate::xla_ffi::*;

/// A call's scratch, host and device, made at its first request: a call that asks for none (the
/// usual one) carries one empty pointer and has nothing to drop. It holds no lifetime (the
/// device blocks are given back with the call's API table by [`Scratch::release`], which the
/// `Call`'s drop runs), so `Call<'a>` stays covariant in `'a`.
#[derive(Default)]
pub(super) struct Scratch(std::cell::OnceCell<Box<Arenas>>);

struct Arenas {
    host: Arena,
    device: DeviceArena,
}

impl Scratch {
    fn arenas(&self) -> &Arenas {
        self.0.get_or_init(|| Box::new(Arenas { host: Arena::default(), device: DeviceArena::default() }))
    }

    /// [`Arena::alloc`] of the call's host arena.
    #[allow(clippy::mut_from_ref)] // each call returns a fresh allocation: no two slices alias
    pub(super) fn host<T: Copy + Default>(&self, n: usize) -> Result<&mut [T]> {
        self.arenas().host.alloc(n)
    }

    /// [`DeviceArena::alloc`] of the call's device arena (`api` and `ctx`: the call's).
    pub(super) fn device(
        &self,
        api: Api<'_>,
        ctx: *mut XLA_FFI_ExecutionContext,
        bytes: usize,
        align: usize,
    ) -> Result<*mut c_void> {
        self.arenas().device.alloc(api, ctx, bytes, align)
    }

    /// Gives the device blocks back to XLA (`api` and `ctx`: the call's, the call not yet returned
    /// to XLA); the host blocks are freed when the scratch drops.
    #[inline]
    pub(super) fn release(&mut self, api: Api<'_>, ctx: *mut XLA_FFI_ExecutionContext) {
        if let Some(a) = self.0.get_mut() {
            a.device.release(api, ctx);
        }
    }
}

/// The call's scratch allocations, freed when the call ends (when the [`Call`](super::Call) is
/// dropped, after the body returned).
#[derive(Default)]
pub(super) struct Arena {
    blocks: RefCell<Vec<(NonNull<u8>, Layout)>>,
}

impl Arena {
    /// `n` elements of `T`, each `T::default()`, alive until the arena drops.
    #[allow(clippy::mut_from_ref)] // each call returns a fresh allocation: no two slices alias
    pub(super) fn alloc<T: Copy + Default>(&self, n: usize) -> Result<&mut [T]> {
        let layout = Layout::array::<T>(n).map_err(|_| too_big::<T>(n))?;
        if layout.size() == 0 {
            // No memory: a dangling, aligned pointer is a valid empty (or zero-sized) slice.
            let p = NonNull::<T>::dangling().as_ptr();
            for i in 0..n {
                // SAFETY: writing a zero-sized T through an aligned dangling pointer is valid.
                unsafe { p.add(i).write(T::default()) };
            }
            // SAFETY: aligned, non-NULL, zero bytes; n initialised (zero-sized) values.
            return Ok(unsafe { std::slice::from_raw_parts_mut(p, n) });
        }
        // SAFETY: a layout of non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(block) = NonNull::new(raw) else { return Err(too_big::<T>(n)) };
        self.blocks.borrow_mut().push((block, layout));
        let p = block.as_ptr().cast::<T>();
        for i in 0..n {
            // SAFETY: within the fresh allocation of n T's, aligned for T.
            unsafe { p.add(i).write(T::default()) };
        }
        // SAFETY: a fresh allocation of n initialised T's, owned by the arena until it drops
        // (the returned borrow of `self` ends before), referenced by nothing else.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        for (block, layout) in self.blocks.get_mut().drain(..) {
            // SAFETY: allocated in alloc() with this layout, freed once; T is Copy (no drop).
            unsafe { std::alloc::dealloc(block.as_ptr(), layout) };
        }
    }
}

#[cold]
fn too_big<T>(n: usize) -> FfiError {
    FfiError::new(
        XLA_FFI_Error_Code::RESOURCE_EXHAUSTED,
        format!("scratch: {n} elements of {} could not be allocated", std::any::type_name::<T>()),
    )
}

/// Device memory XLA's allocator lent the call (`XLA_FFI_DeviceMemory_Allocate`), given back
/// (`XLA_FFI_DeviceMemory_Free`) when the call ends.
#[derive(Default)]
pub(super) struct DeviceArena {
    blocks: RefCell<Vec<(*mut c_void, usize)>>,
}

impl DeviceArena {
    /// `bytes` bytes aligned to `align` (a power of two; XLA allows at most 16), from XLA's
    /// allocator (`api` and `ctx`: the call's).
    pub(super) fn alloc(
        &self,
        api: Api<'_>,
        ctx: *mut XLA_FFI_ExecutionContext,
        bytes: usize,
        align: usize,
    ) -> Result<*mut c_void> {
        if !align.is_power_of_two() {
            return Err(FfiError::invalid_argument(format!(
                "device scratch: alignment {align} is not a power of two"
            )));
        }
        let (Some(allocate), Some(_)) =
            (api_field!(api, XLA_FFI_DeviceMemory_Allocate), api_field!(api, XLA_FFI_DeviceMemory_Free))
        else {
            return Err(FfiError::new(
                XLA_FFI_Error_Code::UNIMPLEMENTED,
                "device scratch: the XLA FFI API table has no XLA_FFI_DeviceMemory_Allocate/Free",
            ));
        };
        let mut args = XLA_FFI_DeviceMemory_Allocate_Args {
            struct_size: XLA_FFI_DeviceMemory_Allocate_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            ctx,
            size: bytes,
            alignment: align,
            data: std::ptr::null_mut(),
        };
        // SAFETY: XLA's function with the call's context and arguments of the declared size.
        let err = unsafe { allocate(&mut args) };
        api.check(err, "device scratch")?;
        if args.data.is_null() && bytes > 0 {
            return Err(FfiError::new(
                XLA_FFI_Error_Code::RESOURCE_EXHAUSTED,
                format!("device scratch: XLA gave no memory for {bytes} bytes"),
            ));
        }
        self.blocks.borrow_mut().push((args.data, bytes));
        if (args.data as usize) % align != 0 {
            // Given back with the others when the call ends.
            return Err(FfiError::new(
                XLA_FFI_Error_Code::INTERNAL,
                format!("device scratch: XLA gave {:p}, not aligned to {align}", args.data),
            ));
        }
        Ok(args.data)
    }
}

impl DeviceArena {
    /// Gives every block back to XLA's allocator, once (`api` and `ctx`: the call's, which has not
    /// returned to XLA yet).
    #[inline(never)]
    fn release(&mut self, api: Api<'_>, ctx: *mut XLA_FFI_ExecutionContext) {
        let blocks = std::mem::take(self.blocks.get_mut());
        if blocks.is_empty() {
            return;
        }
        // Present: alloc() made blocks only when the table had both functions.
        let Some(free) = api_field!(api, XLA_FFI_DeviceMemory_Free) else { return };
        for (data, size) in blocks {
            let mut args = XLA_FFI_DeviceMemory_Free_Args {
                struct_size: XLA_FFI_DeviceMemory_Free_Args_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                ctx,
                size,
                data,
            };
            // SAFETY: XLA's function with the call's context (the call has not returned to XLA
            // yet) and memory its allocator gave this call, given back once.
            let err = unsafe { free(&mut args) };
            if let Err(e) = api.check(err, "device scratch") {
                eprintln!("dlbridge: giving back a handler's device scratch failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_distinct_initialised_and_freed() {
        let arena = Arena::default();
        let a = arena.alloc::<f64>(5).unwrap();
        let b = arena.alloc::<u8>(3).unwrap();
        assert_eq!(a, &[0.0; 5]);
        assert_eq!(b, &[0; 3]);
        a.fill(1.5);
        b.fill(7);
        assert_eq!(a, &[1.5; 5]);
        assert_eq!(b, &[7; 3]);
        let empty = arena.alloc::<u32>(0).unwrap();
        assert!(empty.is_empty());
        let units = arena.alloc::<()>(4).unwrap();
        assert_eq!(units.len(), 4);
        drop(arena); // Miri checks that every block is freed once
    }

    #[test]
    #[cfg_attr(miri, ignore = "asks the allocator for more than the address space")]
    fn too_much_is_an_error() {
        let arena = Arena::default();
        let e = arena.alloc::<u64>(usize::MAX / 4).unwrap_err();
        assert_eq!(e.code(), XLA_FFI_Error_Code::RESOURCE_EXHAUSTED);
        assert!(e.message().contains("could not be allocated"), "{}", e.message());
        let e = arena.alloc::<u64>(isize::MAX as usize / 16).unwrap_err();
        assert!(e.message().contains("scratch"), "{}", e.message());
    }
}
