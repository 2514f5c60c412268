//! `image` bridge (feature `image`, no codecs: `default-features = false`): an `ImageBuffer` over
//! a `(height, width, channels)` tensor (HWC, C order; `(height, width)` for one-channel pixels)
//! and an owned `ImageBuffer` exported as one, both without copying.
//!
//! [`ManagedTensor::into_image`] gives an owned `ImageBuffer<P, TensorSamples<_>>` instead: the
//! container owns the tensor (deleted when the image drops) and a shared lease on its memory.
//!
//! An `ImageBuffer` needs its samples contiguous in row-major HWC order, so a tensor in another
//! layout (CHW, a crop with row padding, a flipped axis) is refused; copy it with
//! [`ManagedTensor::to_contiguous`] first. Export takes any owned container that is also a
//! [`HostBuffer`] (`Vec`, `Box<[T]>`, `Arc<[T]>` read-only, [`crate::AlignedBuffer`]); a borrowed
//! container (`&[T]`) cannot outlive its owner, so it is not exported (`to_vec()` it: one copy).
//!
//! ```
//! use dlbridge::ManagedTensor;
//! use image::{ImageBuffer, Rgb};
//! let img: ImageBuffer<Rgb<u8>, Vec<u8>> = ImageBuffer::from_fn(4, 2, |x, y| Rgb([x as u8, y as u8, 7]));
//! let ptr = img.as_raw().as_ptr();
//! let t = ManagedTensor::from_image(img).unwrap();
//! assert_eq!((t.shape(), t.data_ptr().cast_const().cast()), (&[2i64, 4, 3][..], ptr));
//! let g = t.as_image::<Rgb<u8>>().unwrap();
//! assert_eq!(*g.image().get_pixel(3, 1), Rgb([3, 1, 7]));
//! ```

use std::ops::Deref;
use std::ptr::NonNull;

use image::{ImageBuffer, Pixel};

use crate::borrow::Lease;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::export::HostBuffer;
use crate::managed::ManagedTensor;
use crate::view::{SliceMut, SliceRef};

/// A read-only image over a tensor ([`ManagedTensor::as_image`]): a shared slice of its samples
/// (holding a shared lease, see [`crate::borrow`]) and the image's size; [`ImageRef::image`] lends
/// an `ImageBuffer` over the slice for as long as the guard is borrowed.
pub struct ImageRef<'a, P: Pixel> {
    samples: SliceRef<'a, P::Subpixel>,
    width: u32,
    height: u32,
}

/// A mutable image over a tensor ([`ManagedTensor::as_image_mut`]), holding an exclusive lease.
pub struct ImageMut<'a, P: Pixel> {
    samples: SliceMut<'a, P::Subpixel>,
    width: u32,
    height: u32,
}

/// An owned, read-only image container over a tensor's samples ([`ManagedTensor::into_image`]):
/// derefs to the samples, owns the tensor and holds a shared lease on its memory until it drops.
pub struct TensorSamples<T> {
    first: NonNull<T>,
    len: usize,
    _lease: Lease,
    _tensor: ManagedTensor,
}

impl<T> Deref for TensorSamples<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `first` is the first of `len` contiguous, aligned, valid values of T in host
        // memory (checked by `strided_view` and the C-order check in `into_image`; dangling and
        // aligned when empty), kept alive by the tensor owned here; the shared lease keeps
        // dlbridge's mutable access away while this container lives.
        unsafe { std::slice::from_raw_parts(self.first.as_ptr(), self.len) }
    }
}

// SAFETY: the container is a shared slice that owns what it points into: the tensor is Send and
// Sync, the lease too, and sharing `&[T]` across threads needs `T: Sync`.
unsafe impl<T: Sync> Send for TensorSamples<T> {}
// SAFETY: as above; `&TensorSamples` only gives `&[T]`.
unsafe impl<T: Sync> Sync for TensorSamples<T> {}

impl<T> std::fmt::Debug for TensorSamples<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorSamples").field("len", &self.len).finish_non_exhaustive()
    }
}

impl<P: Pixel> std::fmt::Debug for ImageRef<'_, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageRef")
            .field("width", &self.width)
            .field("height", &self.height)
            .finish_non_exhaustive()
    }
}

impl<P: Pixel> std::fmt::Debug for ImageMut<'_, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageMut")
            .field("width", &self.width)
            .field("height", &self.height)
            .finish_non_exhaustive()
    }
}

impl<P: Pixel> ImageRef<'_, P> {
    /// The image, borrowed from the guard.
    pub fn image(&self) -> ImageBuffer<P, &[P::Subpixel]> {
        ImageBuffer::from_raw(self.width, self.height, &*self.samples).expect("size checked on creation")
    }
}

impl<P: Pixel> ImageMut<'_, P> {
    /// The image, read-only, borrowed from the guard.
    pub fn image(&self) -> ImageBuffer<P, &[P::Subpixel]> {
        ImageBuffer::from_raw(self.width, self.height, &*self.samples).expect("size checked on creation")
    }

    /// The image, mutable, borrowed from the guard.
    pub fn image_mut(&mut self) -> ImageBuffer<P, &mut [P::Subpixel]> {
        ImageBuffer::from_raw(self.width, self.height, &mut *self.samples).expect("size checked on creation")
    }
}

impl ManagedTensor {
    /// The image size of an HWC tensor of `P`'s channel count (`(h, w)` for one channel).
    fn image_size<P: Pixel>(&self) -> Result<(u32, u32)> {
        let c = u64::from(P::CHANNEL_COUNT);
        let s = self.shape();
        let ok = match *s {
            [h, w, ch] if ch as u64 == c => Some((h, w)),
            [h, w] if c == 1 => Some((h, w)),
            _ => None,
        };
        let size = ok.and_then(|(h, w)| Some((u32::try_from(w).ok()?, u32::try_from(h).ok()?)));
        size.ok_or_else(|| Error::Incompatible {
            expected: format!(
                "an image tensor of shape (height, width, {c}){} with height and width below 2^32",
                if c == 1 { " or (height, width)" } else { "" }
            ),
            found: self.describe(),
        })
    }

    /// A read-only `ImageBuffer<P, &[P::Subpixel]>` over a C-contiguous HWC host tensor of
    /// dtype `P::Subpixel` and `P::CHANNEL_COUNT` channels, without copying. Holds a shared lease
    /// (through [`ManagedTensor::as_slice`]).
    pub fn as_image<P: Pixel>(&self) -> Result<ImageRef<'_, P>>
    where
        P::Subpixel: Element,
    {
        let (width, height) = self.image_size::<P>()?;
        Ok(ImageRef { samples: self.as_slice()?, width, height })
    }

    /// A mutable `ImageBuffer<P, &mut [P::Subpixel]>` over a writable C-contiguous HWC tensor;
    /// holds an exclusive lease (through [`ManagedTensor::as_slice_mut`]).
    pub fn as_image_mut<P: Pixel>(&mut self) -> Result<ImageMut<'_, P>>
    where
        P::Subpixel: Element,
    {
        let (width, height) = self.image_size::<P>()?;
        Ok(ImageMut { samples: self.as_slice_mut()?, width, height })
    }

    /// This HWC tensor as an owned, read-only `ImageBuffer` without copying: the container owns
    /// the tensor (its deleter runs when the image drops) and a shared lease on its memory.
    ///
    /// ```
    /// use dlbridge::ManagedTensor;
    /// let t = ManagedTensor::from_vec(vec![9u8; 2 * 3], &[2, 3, 1]).unwrap();
    /// let ptr = t.data_ptr().cast_const().cast::<u8>();
    /// let img = t.into_image::<image::Luma<u8>>().unwrap();
    /// assert_eq!((img.dimensions(), img.as_raw().as_ptr()), ((3, 2), ptr));
    /// ```
    pub fn into_image<P: Pixel>(self) -> Result<ImageBuffer<P, TensorSamples<P::Subpixel>>>
    where
        P::Subpixel: Element,
    {
        let (width, height) = self.image_size::<P>()?;
        if !self.is_c_contiguous() {
            return Err(self.refuse_view::<P::Subpixel>(false, " in C order (an ImageBuffer is packed HWC)"));
        }
        let (first, lease) = self.strided_view::<P::Subpixel>(false)?;
        let len = self.numel();
        let samples = TensorSamples { first, len, _lease: lease, _tensor: self };
        Ok(ImageBuffer::from_raw(width, height, samples).expect("size checked above"))
    }

    /// Exports an owned `ImageBuffer` as a `(height, width, channels)` tensor (C order) without
    /// copying: its container becomes the tensor's buffer (read-only for `Arc<[T]>`).
    pub fn from_image<P: Pixel, C>(img: ImageBuffer<P, C>) -> Result<Self>
    where
        P::Subpixel: Element,
        C: Deref<Target = [P::Subpixel]> + HostBuffer<Elem = P::Subpixel>,
    {
        let (w, h) = img.dimensions();
        let shape = [h as usize, w as usize, usize::from(P::CHANNEL_COUNT)];
        let strides = [(shape[1] * shape[2]) as isize, shape[2] as isize, 1];
        // The container may be longer than the image (`from_raw` allows it): the strided export
        // checks the image fits and ignores the rest.
        ManagedTensor::from_host_strided(img.into_raw(), &shape, &strides, 0)
    }
}
