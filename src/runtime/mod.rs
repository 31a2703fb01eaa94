//! Safe handles over the CUDA driver and NCCL: device contexts, loaded kernel
//! modules, the communicator, and the thin checked NCCL calls.

pub mod comm;
pub mod device;
pub mod module;
pub mod nccl_call;
pub mod nvtx;

pub use comm::Communicator;
pub use device::{context, device_count, driver, MappedHost};
pub use module::{Function, Module};
pub use nccl_call::UniqueId;
