//! The image bridge: ImageBuffer over HWC tensors and owned ImageBuffers exported.
#![cfg(feature = "image")]

use std::sync::Arc;

use dlbridge::{Error, ManagedTensor, RawManagedTensor};
use image::{ImageBuffer, Luma, Rgb, Rgba};

fn through_abi(t: ManagedTensor) -> ManagedTensor {
    let RawManagedTensor::Versioned(p) = t.into_raw() else { panic!("exports are versioned") };
    // SAFETY: a pointer just given up by a ManagedTensor.
    unsafe { ManagedTensor::from_raw_versioned(p) }.unwrap()
}

#[test]
fn owned_image_round_trip_is_zero_copy_and_writes_are_shared() {
    let img = ImageBuffer::from_fn(5, 3, |x, y| Rgba([x as u16, y as u16, 9, 65535]));
    let ptr = img.as_raw().as_ptr();
    let mut t = through_abi(ManagedTensor::from_image(img).unwrap());
    assert_eq!((t.shape(), t.strides()), (&[3i64, 5, 4][..], &[20i64, 4, 1][..]));
    assert_eq!(t.data_ptr().cast_const().cast::<u16>(), ptr);
    {
        let mut g = t.as_image_mut::<Rgba<u16>>().unwrap();
        let mut im = g.image_mut();
        assert_eq!(im.as_raw().as_ptr(), ptr);
        im.put_pixel(4, 2, Rgba([1, 2, 3, 4]));
    }
    assert_eq!(t.get::<u16>(&[2, 4, 2]).unwrap(), 3);
    let g = t.as_image::<Rgba<u16>>().unwrap();
    assert_eq!(*g.image().get_pixel(1, 2), Rgba([1, 2, 9, 65535]));
}

#[test]
fn containers_other_than_vec() {
    let shared: Arc<[f32]> = Arc::from(vec![0.5f32; 2 * 2 * 3]);
    let ptr = shared.as_ptr();
    let img: ImageBuffer<Rgb<f32>, Arc<[f32]>> = ImageBuffer::from_raw(2, 2, shared).unwrap();
    let mut t = ManagedTensor::from_image(img).unwrap();
    assert!(t.is_read_only());
    assert_eq!(t.data_ptr().cast_const().cast::<f32>(), ptr);
    assert!(t.as_image_mut::<Rgb<f32>>().is_err());
    // A Vec longer than the image: the tensor is the image, the tail is not part of it.
    let img: ImageBuffer<Luma<u8>, Vec<u8>> = ImageBuffer::from_raw(2, 2, vec![1, 2, 3, 4, 5, 6]).unwrap();
    let t = ManagedTensor::from_image(img).unwrap();
    assert_eq!((t.shape(), t.numel()), (&[2i64, 2, 1][..], 4));
}

#[test]
fn one_channel_images_take_2d_tensors() {
    let t = ManagedTensor::from_vec((0..6).collect::<Vec<u8>>(), &[2, 3]).unwrap();
    let g = t.as_image::<Luma<u8>>().unwrap();
    assert_eq!((g.image().dimensions(), g.image().get_pixel(2, 1).0), ((3, 2), [5]));
}

#[test]
fn refusals_name_what_is_wrong() {
    let t = ManagedTensor::from_vec(vec![0u8; 2 * 2 * 4], &[2, 2, 4]).unwrap();
    let e = t.as_image::<Rgb<u8>>().unwrap_err().to_string();
    assert_eq!(
        e,
        "expected an image tensor of shape (height, width, 3) with height and width below 2^32, got uint8 \
         shape (2, 2, 4) strides (8, 4, 1) on cpu"
    );
    // CHW (a transposed HWC): not row-major HWC.
    let chw = ManagedTensor::from_host_strided(vec![0u8; 12], &[2, 2, 3], &[2, 1, 4], 0).unwrap();
    let e = chw.as_image::<Rgb<u8>>().unwrap_err().to_string();
    assert!(e.starts_with("expected uint8 C-contiguous cpu tensor, got uint8 (2, 2, 3) strides"), "{e}");
    let f = ManagedTensor::from_vec(vec![0f32; 12], &[2, 2, 3]).unwrap();
    assert!(f.as_image::<Rgb<u8>>().unwrap_err().to_string().contains("expected uint8"));
}

#[test]
fn a_mutable_image_excludes_other_handles() {
    let t = Arc::new(ManagedTensor::from_vec(vec![0u8; 12], &[2, 2, 3]).unwrap());
    // SAFETY: fresh exports of a live tensor.
    let mut a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    let g = a.as_image_mut::<Rgb<u8>>().unwrap();
    assert!(matches!(b.as_image::<Rgb<u8>>(), Err(Error::AlreadyBorrowed { .. })));
    drop(g);
    assert!(b.as_image::<Rgb<u8>>().is_ok());
}

#[test]
fn into_image_owns_the_tensor_and_its_lease() {
    let t = Arc::new(ManagedTensor::from_vec((0..12).collect::<Vec<u8>>(), &[2, 2, 3]).unwrap());
    // SAFETY: fresh exports of a live tensor.
    let a = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    // SAFETY: as above.
    let mut b = unsafe { ManagedTensor::from_raw_versioned(t.export_versioned().as_ptr()) }.unwrap();
    let img = a.into_image::<Rgb<u8>>().unwrap();
    assert_eq!(img.as_raw().as_ptr(), t.data_ptr().cast_const().cast::<u8>());
    assert_eq!(*img.get_pixel(1, 1), Rgb([9, 10, 11]));
    assert!(matches!(b.as_slice_mut::<u8>(), Err(Error::AlreadyBorrowed { .. })));
    assert_eq!(Arc::strong_count(&t), 3);
    drop(img);
    assert_eq!(Arc::strong_count(&t), 2, "the image's tensor was released with it");
    b.as_slice_mut::<u8>().unwrap()[0] = 1;
    let f = ManagedTensor::from_host_strided(vec![0u8; 12], &[2, 2, 3], &[3, 6, 1], 0).unwrap();
    let e = f.into_image::<Rgb<u8>>().unwrap_err().to_string();
    assert!(e.contains("in C order"), "{e}");
}
