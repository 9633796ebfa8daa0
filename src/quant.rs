//! Scalar reference kernels for every tensor type (in progress).
