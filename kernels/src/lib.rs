//! tandem compute kernels (being built).
