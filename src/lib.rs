//! # moe-ep
//!
//! Expert-parallel communication kernels for Mixture-of-Experts models:
//! **dispatch** sends every token to the GPUs of its top-k experts,
//! **combine** brings the expert outputs home and reduces them. The kernels
//! are handwritten CUDA (`kernels-cuda/`), compiled by build.rs to sm_90a
//! cubin + PTX and embedded in the crate; NVLink peers exchange data through
//! NCCL symmetric memory (`symm`).
//!
//! Layers, each calling only the one below: `sys` (raw NCCL, loaded at run
//! time) → [`runtime`] (contexts, modules, communicator) → [`symm`] (the
//! symmetric-memory pool) → [`ops`] (layout, dispatch, combine) → this file.
//! [`reference`](mod@reference) is the CPU implementation everything is checked against;
//! The C ABI over this file's API (`capi/include/moe_ep.h`, libmoe_ep.so)
//! is the workspace crate `moe-ep-capi` in `capi/`.
//!
//! Cargo features: `testkit` (seeded workloads and baseline copy kernels for
//! the tests and ep-bench), `raw` (the raw layers for tools that measure
//! beside the library: `sys`, `runtime::nccl_call`, `runtime::MappedHost`,
//! `runtime::Module` / `Function` with their launches, `UniqueId`'s
//! inner `ncclUniqueId`, and the inter-node path's network hop
//! `ops::rail_hop`), `multi-gpu` (the GPU tests).

pub mod error;
pub(crate) mod kernels;
pub mod ops;
pub mod reference;
pub mod runtime;
pub mod symm;
#[cfg(feature = "raw")]
pub mod sys;
#[cfg(not(feature = "raw"))]
#[cfg_attr(not(feature = "raw"), allow(dead_code))]
// the header's mirror: the raw API uses the rest
pub(crate) mod sys;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod types;
pub use types::{Fp8Scaling, LlLayout, RecvLayout, Topology};

pub use error::{Error, NcclVersion, Result};
pub use kernels::NCCL_HEADERS_VERSION_CODE;
pub use ops::{
    DeviceRegion, DeviceRegionMut, DispatchBackwardArgs, DispatchOut, DispatchOutFp8, Dispatched,
    DispatchedFp8, EpGroup, Fp8Rows, Fp8Scales, GroupConfig, Handle, HostCounts, LlDispatchArgs,
    LlHandle, LlInput, MemoryFootprint, Mode, Overflow, RecvBuf, RecvScales, RecvScalesOut,
    RefusedCall, TopkIdx,
};
pub use runtime::{context, device_count, Communicator, UniqueId};
pub use symm::{SymmBuffer, SymmPool, SymmView, SymmViewMut};

/// cudarc's driver types used in this crate's API (contexts, streams, slices).
pub use cudarc::driver as cuda;
/// bf16 as used for tokens.
pub use half::bf16;
