//! Launchers of `kernels-cuda/util.cu`: a pattern writer and checker (the
//! symmetric-memory tests), the SM copy loop that measures the peer-store
//! ceiling, the bulk-copy (TMA) loop that measures the bulk-copy ceiling and
//! the row fan-out / fan-in loop that measures the local-copy ceilings
//! (ep-bench). Raw device addresses: these exist to poke at peers'
//! memory on purpose.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use crate::error::{Error, Result};
use crate::ops::abi::{COMBINE_SMEM, THREADS};
use crate::ops::DeviceRegion;
use crate::runtime::Module;

fn grid_for(n: u64, per_block: u64, max: u32) -> u32 {
    n.div_ceil(per_block).clamp(1, max as u64) as u32
}

/// Writes `pattern(seed, i)` into `n` u32 at `dst` (possibly a peer's copy).
///
/// # Safety
/// `dst` must be a device address writable for `n` u32 until the kernel ran.
pub unsafe fn fill_pattern(stream: &Arc<CudaStream>, dst: u64, n: u64, seed: u32) -> Result<()> {
    let f = Module::get(stream.context(), "util")?.function("moe_ep_fill_pattern")?;
    let (mut d, mut n_, mut s) = (dst, n, seed);
    let mut args = [
        &mut d as *mut _ as *mut c_void,
        &mut n_ as *mut _ as *mut c_void,
        &mut s as *mut _ as *mut c_void,
    ];
    f.launch_raw(stream, grid_for(n, 256, 1024), 256, 0, &mut args)
}

/// Number of elements of `src` that differ from `pattern(seed, i)`
/// (synchronises `stream`).
pub fn pattern_mismatches(
    stream: &Arc<CudaStream>,
    src: &dyn DeviceRegion<u32>,
    seed: u32,
) -> Result<u64> {
    let f = Module::get(stream.context(), "util")?.function("moe_ep_check_pattern")?;
    let counter = stream
        .alloc_zeros::<u64>(1)
        .map_err(Error::cuda("cuMemAlloc"))?;
    let (mut p, mut n, mut s, mut c) = (
        src.device_ptr(),
        src.len() as u64,
        seed,
        counter.device_ptr(),
    );
    let mut args = [
        &mut p as *mut _ as *mut c_void,
        &mut n as *mut _ as *mut c_void,
        &mut s as *mut _ as *mut c_void,
        &mut c as *mut _ as *mut c_void,
    ];
    // SAFETY: matches moe_ep_check_pattern(const u32*, u64, u32, u64*).
    unsafe { f.launch_raw(stream, grid_for(n, 256, 1024), 256, 0, &mut args)? };
    // Drained before the pageable copy (see `Handle::host_counts`).
    stream
        .synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    let v = stream
        .clone_dtoh(&counter)
        .map_err(Error::cuda("cuMemcpyDtoH"))?;
    stream
        .synchronize()
        .map_err(Error::cuda("cuStreamSynchronize"))?;
    Ok(v[0])
}

/// Copies `bytes` (a multiple of 16) from `src` to `dst` with `blocks` SMs
/// of 16-byte loads and stores: the peer-store ceiling when `dst` is a peer's
/// buffer, the peer-load ceiling when `src` is.
///
/// # Safety
/// Both ranges must be valid device memory until the kernel ran.
pub unsafe fn sm_copy(
    stream: &Arc<CudaStream>,
    src: u64,
    dst: u64,
    bytes: u64,
    blocks: u32,
) -> Result<()> {
    launch_copy(
        stream,
        "moe_ep_copy_v4",
        (src, dst, bytes),
        bytes / 16,
        blocks,
        0,
    )
}

/// Copies `bytes` (a multiple of 16) from `src` to `dst` with the
/// bulk-copy (TMA) units of `blocks` SMs, one issuing thread each, through a
/// ring of shared buffers: the bulk-copy ceiling when `dst` is a peer's buffer
/// (the combine pusher moves rows the same way), the bulk-load ceiling when
/// `src` is.
///
/// # Safety
/// Both ranges must be valid device memory until the kernel ran.
pub unsafe fn bulk_copy(
    stream: &Arc<CudaStream>,
    src: u64,
    dst: u64,
    bytes: u64,
    blocks: u32,
) -> Result<()> {
    launch_copy(
        stream,
        "moe_ep_bulk_copy",
        (src, dst, bytes),
        bytes,
        blocks,
        COMBINE_SMEM,
    )
}

/// Moves rows on one GPU the way an op of one receive layout moves them,
/// with `blocks` SMs of 16-byte loads and stores: the local-copy ceiling.
/// `src` holds `src_rows` rows, `dst` holds `dst_rows` rows, each of
/// `row_bytes` bytes (a multiple of 16; both addresses 16-byte aligned).
///
/// * `dst_rows >= src_rows` (fan-out, as dispatch): source row `i` is read
///   once and stored into destination rows `i * D / S .. (i + 1) * D / S`
///   (`D / S` of them, rounded down or up: every destination row exactly
///   once). Without source rows every destination row is zeroed.
/// * `src_rows > dst_rows` (fan-in, as combine): destination row `j` is
///   stored once, the xor of source rows `j * S / D .. (j + 1) * S / D`
///   (16-byte vectors), so every source byte is read.
///
/// Either way it reads `src_rows * row_bytes` and writes
/// `dst_rows * row_bytes` bytes (with no destination row it does nothing).
///
/// # Safety
/// `src` must be readable for `src_rows * row_bytes` bytes and `dst`
/// writable for `dst_rows * row_bytes` bytes until the kernel ran; the two
/// ranges must not overlap.
pub unsafe fn fan_copy(
    stream: &Arc<CudaStream>,
    (src, src_rows): (u64, u64),
    (dst, dst_rows): (u64, u64),
    row_bytes: u64,
    blocks: u32,
) -> Result<()> {
    if !row_bytes.is_multiple_of(16) {
        return Err(Error::arg("row_bytes", "a multiple of 16", row_bytes));
    }
    for (what, at) in [("src", src), ("dst", dst)] {
        if !at.is_multiple_of(16) {
            return Err(Error::arg(
                what,
                "a 16-byte aligned address",
                format!("{at:#x}"),
            ));
        }
    }
    let f = Module::get(stream.context(), "util")?.function("moe_ep_fan_copy_v4")?;
    let (mut s, mut d, mut sr, mut dr, mut v) = (src, dst, src_rows, dst_rows, row_bytes / 16);
    let mut args = [
        &mut s as *mut _ as *mut c_void,
        &mut d as *mut _ as *mut c_void,
        &mut sr as *mut _ as *mut c_void,
        &mut dr as *mut _ as *mut c_void,
        &mut v as *mut _ as *mut c_void,
    ];
    // SAFETY: matches moe_ep_fan_copy_v4(const int4*, int4*, u64, u64, u64);
    // the ranges are the caller's promise.
    f.launch_raw(stream, blocks.max(1), THREADS, 0, &mut args)
}

/// Launches the copy kernel `name(src, dst, count)` on `blocks` blocks with
/// `smem` bytes of dynamic shared memory, once `bytes` is a multiple of 16.
unsafe fn launch_copy(
    stream: &Arc<CudaStream>,
    name: &'static str,
    (src, dst, bytes): (u64, u64, u64),
    count: u64,
    blocks: u32,
    smem: u32,
) -> Result<()> {
    if !bytes.is_multiple_of(16) {
        return Err(Error::arg("bytes", "a multiple of 16", bytes));
    }
    let f = Module::get(stream.context(), "util")?.function(name)?;
    if smem > 0 {
        f.allow_dynamic_smem(smem)?;
    }
    let (mut s, mut d, mut n) = (src, dst, count);
    let mut args = [
        &mut s as *mut _ as *mut c_void,
        &mut d as *mut _ as *mut c_void,
        &mut n as *mut _ as *mut c_void,
    ];
    f.launch_raw(stream, blocks.max(1), THREADS, smem, &mut args)
}
