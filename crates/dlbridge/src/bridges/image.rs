//! `image` bridge (feature `image`, no codecs: `default-features = false`): an `ImageBuffer` over
//! a `(height, width, channels)` tensor (HWC, C order; `(height, width)` for one-channel pixels)
//! and an owned `ImageBuffer` exported as one, both without copying.
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

use image::{ImageBuffer, Pixel};

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
