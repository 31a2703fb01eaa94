//! The kernel images build.rs compiled from `kernels-cuda/` (sm_90a cubin +
//! compute_90 PTX per `.cu`), and the NCCL header version they were built with.
include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
