//! The Python face of moe-ep: the extension module `moe_ep._moe_ep`,
//! inside the pure-Python package `moe_ep` (`python/moe_ep/`), which adds
//! torch's streams, allocations, tensors and autograd on top.
//!
//! No torch at build time: arrays cross the boundary through DLPack and
//! `__cuda_array_interface__` ([`dlpack`]), streams as raw handles
//! ([`stream`]). Every op runs with the GIL released (on a virtual world an
//! op ends when every rank has enqueued it, and the ranks are Python
//! threads); every error becomes the exception of its kind in
//! `moe_ep.errors` and a panic never crosses into Python ([`errors`]).
//!
//! # Files
//!
//! `errors.rs` (exceptions, the GIL and panic guards), `dlpack.rs` (arrays
//! in and out), `stream.rs` (the caller's streams), `group.rs`
//! (communicators, groups, the high-throughput ops, handles),
//! `low_latency.rs` (the low-latency mode), `alloc.rs` (torch's pluggable
//! allocator over a group's symmetric pool), `bench.rs` (the same ops from
//! Rust, for the overhead measurement).

mod alloc;
mod bench;
mod dlpack;
mod errors;
mod group;
mod low_latency;
mod stream;

use pyo3::prelude::*;

#[pymodule]
mod _moe_ep {
    #[pymodule_export]
    use crate::alloc::{_set_allocation_group, _torch_allocations};
    #[pymodule_export]
    use crate::bench::_rust_loop;
    #[pymodule_export]
    use crate::dlpack::{_check_array, DeviceArray};
    #[pymodule_export]
    use crate::errors::_raise_for_tests;
    #[pymodule_export]
    use crate::group::{_check_fp8_args, device_count, unique_id, Comm, Group, Handle};
    #[pymodule_export]
    use crate::low_latency::{
        ll_combine, ll_combine_send, ll_combine_wait, ll_dispatch, ll_dispatch_wait, LlBatch,
    };

    use pyo3::prelude::*;

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "NCCL_HEADERS_VERSION",
            moe_ep::NcclVersion::from_code(moe_ep::NCCL_HEADERS_VERSION_CODE).to_string(),
        )?;
        Ok(())
    }
}
