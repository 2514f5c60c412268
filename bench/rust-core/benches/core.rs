//! Core paths of dlbridge, without Python: exporting a Vec-backed tensor and dropping it (the
//! deleter frees the Vec), and validating an imported 1-d and 4-d tensor (the door every foreign
//! tensor goes through).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dlbridge::{ManagedTensor, RawManagedTensor};

fn export_and_drop(c: &mut Criterion) {
    let mut g = c.benchmark_group("export");
    g.bench_function("vec_1e3_f32_export_drop", |b| {
        b.iter_batched(
            || vec![0f32; 1000],
            |v| drop(black_box(ManagedTensor::from_vec(v, &[1000]).unwrap())),
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("vec_4d_f32_export_drop", |b| {
        b.iter_batched(
            || vec![0f32; 2 * 3 * 4 * 5],
            |v| drop(black_box(ManagedTensor::from_vec(v, &[2, 3, 4, 5]).unwrap())),
            criterion::BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// Validation alone: a raw versioned pointer taken in (validated) and handed back out, repeatedly.
fn validate(c: &mut Criterion) {
    let mut g = c.benchmark_group("validate");
    for (name, shape) in [("1d", vec![1000usize]), ("4d", vec![2, 3, 4, 5])] {
        let n = shape.iter().product();
        let t = ManagedTensor::from_vec(vec![0f32; n], &shape).unwrap();
        let RawManagedTensor::Versioned(mut raw) = t.into_raw() else { unreachable!() };
        g.bench_function(name, |b| {
            b.iter(|| {
                // SAFETY: `raw` is owned here; each iteration takes it in and gives it back.
                let t = unsafe { ManagedTensor::from_raw_versioned(black_box(raw)) }.unwrap();
                black_box(t.data_ptr());
                let RawManagedTensor::Versioned(r) = t.into_raw() else { unreachable!() };
                raw = r;
            })
        });
        // SAFETY: owned; dropped once.
        drop(unsafe { ManagedTensor::from_raw_versioned(raw) });
    }
    g.finish();
}

criterion_group!(benches, export_and_drop, validate);
criterion_main!(benches);
