//! Safe handles over the CUDA driver and NCCL: device contexts, loaded kernel
//! modules, the communicator (NCCL or virtual ranks with in-process host
//! collectives), and the thin checked NCCL calls.

pub mod comm;
pub mod device;
pub mod host_group;
pub mod module;
pub mod nccl_call;
pub mod nvtx;

pub use comm::{Communicator, VIRTUAL_HOST_TIMEOUT};
pub use device::{context, device_count, driver, MappedHost};
pub use host_group::HostGroup;
pub use module::{Function, Module};
pub use nccl_call::UniqueId;
