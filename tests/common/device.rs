//! Host-device helpers of the multi-rank GPU tests (`gpu_intranode.rs`,
//! `gpu_two_level.rs`, `gpu_low_latency.rs`): uploads and downloads on a drained stream, bit
//! views and the first difference of two results.
#![allow(dead_code)]

use std::sync::Arc;

use moe_ep::cuda::{CudaSlice, CudaStream};
use moe_ep::ops::DeviceRegion;
use moe_ep::testkit::ranks::ensure;
use moe_ep::{bf16, Error, RecvLayout, Result};

pub fn weights_per_row(layout: RecvLayout, k: usize) -> usize {
    match layout {
        RecvLayout::RankMajor => k,
        RecvLayout::ExpertMajor { .. } => 1,
    }
}

pub fn up<T: moe_ep::cuda::DeviceRepr + moe_ep::cuda::ValidAsZeroBits>(
    s: &Arc<CudaStream>,
    v: &[T],
) -> Result<CudaSlice<T>> {
    if v.is_empty() {
        return s.alloc_zeros::<T>(1).map_err(Error::cuda("alloc"));
    }
    drain(s)?;
    s.clone_htod(v).map_err(Error::cuda("htod"))
}

pub fn up_len<T: moe_ep::cuda::DeviceRepr + moe_ep::cuda::ValidAsZeroBits + Copy + Default>(
    s: &Arc<CudaStream>,
    v: &[T],
    len: usize,
) -> Result<CudaSlice<T>> {
    let mut full = v.to_vec();
    full.resize(len.max(v.len()).max(1), T::default());
    up(s, &full)
}

pub fn down<T: moe_ep::cuda::DeviceRepr + Default + Clone>(
    s: &Arc<CudaStream>,
    ptr: &dyn DeviceRegion<T>,
    n: usize,
) -> Result<Vec<T>> {
    let mut host = vec![T::default(); n];
    if n == 0 {
        return Ok(host);
    }
    ensure(ptr.len() >= n, || {
        format!("download of {n} elements from a region of {}", ptr.len())
    })?;
    drain(s)?;
    // SAFETY: ptr holds at least n elements (checked above).
    unsafe {
        moe_ep::cuda::result::memcpy_dtoh_async(&mut host, ptr.device_ptr(), s.cu_stream())
            .map_err(Error::cuda("dtoh"))?;
    }
    s.synchronize().map_err(Error::cuda("sync"))?;
    Ok(host)
}

/// Waits for the stream's work before a copy from or to pageable memory:
/// the driver moves pageable copies of all threads through shared staging
/// buffers, so a copy queued behind this rank's kernels (which wait for the
/// other ranks) would hold up the other virtual ranks' copies and launches.
pub fn drain(s: &Arc<CudaStream>) -> Result<()> {
    s.synchronize().map_err(Error::cuda("sync"))
}

pub fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn f32_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub fn first_diff<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) -> Result<()> {
    ensure(got.len() == want.len(), || {
        format!("{what}: {} values, want {}", got.len(), want.len())
    })?;
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        return Err(Error::InvalidState(format!(
            "{what}: first difference at {i}: got {:?}, want {:?}",
            got[i], want[i]
        )));
    }
    Ok(())
}

/// Holds `s` for `ms` milliseconds (a host function on the stream): what
/// is enqueued after it waits.
pub fn hold(s: &Arc<CudaStream>, ms: usize) -> Result<()> {
    unsafe extern "C" fn sleep_ms(arg: *mut std::ffi::c_void) {
        std::thread::sleep(std::time::Duration::from_millis(arg as usize as u64));
    }
    // SAFETY: the function only sleeps; its argument is a number.
    unsafe {
        moe_ep::cuda::result::stream::launch_host_function(
            s.cu_stream(),
            sleep_ms,
            ms as *mut std::ffi::c_void,
        )
    }
    .map_err(Error::cuda("cuLaunchHostFunc"))
}
