//! Empty: this crate only holds the criterion benchmarks in `benches/`.
