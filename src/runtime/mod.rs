//! Safe handles over the CUDA driver and NCCL: device contexts, loaded kernel
//! modules, the communicator (NCCL or virtual ranks with in-process host
//! collectives), and the thin checked NCCL calls.
//!
//! The raw layers (the NCCL calls, mapped host memory, kernel modules and
//! their launches) are public only with the Cargo feature `raw`, for tools
//! that measure beside the library.

pub mod comm;
pub mod device;
pub mod host_group;
#[cfg(feature = "raw")]
pub mod mapped;
#[cfg(not(feature = "raw"))]
pub(crate) mod mapped;
#[cfg(feature = "raw")]
pub mod module;
#[cfg(not(feature = "raw"))]
pub(crate) mod module;
#[cfg(feature = "raw")]
pub mod nccl_call;
#[cfg(not(feature = "raw"))]
pub(crate) mod nccl_call;
pub mod nvtx;

pub use comm::{Communicator, VIRTUAL_HOST_TIMEOUT};
pub use device::{borrow_stream, context, device_count, driver};
pub use host_group::HostGroup;
#[cfg(feature = "raw")]
pub use mapped::MappedHost;
#[cfg(not(feature = "raw"))]
pub(crate) use mapped::MappedHost;
#[cfg(feature = "raw")]
pub use module::{Function, Module};
#[cfg(not(feature = "raw"))]
pub(crate) use module::{Function, Module};
pub use nccl_call::UniqueId;
