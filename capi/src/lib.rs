//! The C ABI of moe-ep: `capi/include/moe_ep.h`, built into `libmoe_ep.so`
//! and `libmoe_ep.a` (this crate's `cdylib` and `staticlib`) over moe-ep's
//! Rust API.
//!
//! Every function is `extern "C"`, returns a status code and catches panics
//! ([`MOE_EP_ERR_INTERNAL`]); a failing call leaves the Rust
//! [`Error`](moe_ep::Error)'s text in a thread-local message
//! (`moe_ep_last_error`). Versioned structs (size and magic first) are read
//! through [`Versioned`]: a wrong magic or a size below the first version's
//! is refused naming the argument and the struct, a smaller (older) struct
//! takes defaults for the fields it lacks, and a larger (newer) one is
//! accepted when its extra bytes are zero.
//!
//! The header is written by hand; `capi/tests/capi.rs` compiles it as C11
//! and C++17, builds `capi/tests/abi_test.c` against the static and the
//! shared library, and compares every struct's size and field offsets as
//! the C compiler lays them out with the `#[repr(C)]` mirrors here.
//!
//! Low-latency handles: the Rust [`LlHandle`](moe_ep::ops::LlHandle)
//! borrows its group, which C cannot express, so a `moe_ep_group_t` holds
//! its group in an `Arc` and a `moe_ep_ll_handle_t` holds another reference
//! to it beside the batch ([`CLlHandle`]): destroying the group first cannot
//! leave a handle dangling, the group goes with its last handle. Every
//! transition of a batch (sent, received, combine sent, combined) is a call
//! on the handle, which keeps the batch's state under a lock.
//!
//! Buffers arrive as `(device pointer, element count)` and become
//! [`CRegion`]s, this crate's implementation of the unsafe
//! [`DeviceRegion`](moe_ep::ops::DeviceRegion) /
//! [`DeviceRegionMut`](moe_ep::ops::DeviceRegionMut) traits; the caller's
//! obligations are those of the traits, stated in the header. The ops check
//! lengths, alignment and device memory as they do for Rust callers, and
//! this crate adds that no output overlaps another buffer of the call.
//!
//! # Files
//!
//! `status.rs` (status codes, errors, the version calls), `structs.rs` (the
//! versioned structs), `group.rs` (communicators and groups), `ops.rs`
//! (the high-throughput ops), `low_latency.rs` (the low-latency mode),
//! `buffers.rs` (buffers and the symmetric-memory pool).
//!
//! # Library name and versions
//!
//! `MOE_EP_ABI_VERSION` ([`ABI_VERSION`]) grows by one with every release
//! that adds to the ABI; nothing is removed or changed, so a program built
//! against ABI N runs against every library of ABI N or later (the
//! header's rule). The shared library's SONAME, [`SONAME`] =
//! `libmoe_ep.so.1`, carries the ABI's major version, 1 (set by build.rs,
//! `ABI_MAJOR`): it changes only with a change that breaks that rule, so a
//! program linked against any ABI of major 1 loads every later library of
//! major 1, and never one of another major. `capi/install.sh PREFIX`
//! installs the library as `libmoe_ep.so.<major>.<ABI version>` (now
//! `libmoe_ep.so.1.6`) with the links `libmoe_ep.so.1` (the SONAME, for the
//! loader) and `libmoe_ep.so` (for the linker), beside `libmoe_ep.a`, the
//! header, a pkg-config file (`moe_ep.pc`) and a CMake package
//! (`find_package(moe_ep)`: `moe_ep::moe_ep`, `moe_ep::moe_ep_static`),
//! both of version `<major>.<ABI version>`.

#![allow(clippy::missing_safety_doc)] // the header states each function's contract

// moe-ep's Rust API, under its own crate name (this library's crate name is
// `moe_ep` too, for its file names).
extern crate moe_ep_rust as moe_ep;

mod buffers;
mod group;
mod low_latency;
mod ops;
mod status;
mod structs;

pub use buffers::*;
pub use group::*;
pub use low_latency::*;
pub use ops::*;
pub use status::*;
pub use structs::*;

/// The SONAME of `libmoe_ep.so`: `libmoe_ep.so.<ABI major>` (see the
/// crate's doc), set by build.rs.
pub const SONAME: &str = env!("MOE_EP_SONAME");
