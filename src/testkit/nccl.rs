//! What ep-bench measures beside the library through NCCL itself: the
//! all-to-all of the rows a dispatch moves (one group of send/recv pairs),
//! and the start line of a timed run ([`StartGate`]: the stream waits at a
//! host-mapped word, then every rank's GPU leaves a one-word all-reduce
//! together).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use crate::error::{Error, Result};
use crate::ops::DeviceRegion;
use crate::runtime::nccl_call as nc;
use crate::runtime::MappedHost;
use crate::sys::nccl::{ncclSum, ncclUint32, ncclUint8};
use crate::{Communicator, SymmBuffer};

fn nccl_comm(comm: &Communicator) -> Result<crate::sys::nccl::ncclComm_t> {
    comm.raw().ok_or_else(|| {
        Error::arg(
            "comm",
            "an NCCL communicator (virtual ranks have no NCCL)",
            "a virtual rank",
        )
    })
}

/// One NCCL group of send/recv pairs on `stream` moving this rank's
/// dispatch rows: `counts[s * world + d]` rows of `row` bytes from rank s
/// to rank d, with every rank when `with_self` (the all-to-all, as PyTorch's
/// `all_to_all_single` issues it for uneven splits), else with the peers
/// only. Rows for rank d start, in both buffers, at the sum over the ranks
/// before d of the larger of the two directions' sizes; `send` and `recv`
/// must hold that sum over all ranks.
pub fn exchange_rows(
    comm: &Communicator,
    stream: &Arc<CudaStream>,
    send: &SymmBuffer<u8>,
    recv: &SymmBuffer<u8>,
    counts: &[u32],
    row: usize,
    with_self: bool,
) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world());
    let raw = nccl_comm(comm)?;
    if counts.len() != world * world {
        return Err(Error::arg(
            "counts",
            format!("[{world} * {world}] rows per (source, destination)"),
            format!("{} entries", counts.len()),
        ));
    }
    let total: usize = (0..world)
        .map(|d| (counts[rank * world + d].max(counts[d * world + rank])) as usize * row)
        .sum();
    if send.len() < total || recv.len() < total {
        return Err(Error::arg(
            "send/recv",
            format!("at least {total} bytes each"),
            format!("{} and {} bytes", send.len(), recv.len()),
        ));
    }
    let cs = stream.cu_stream() as *mut c_void;
    nc::group_start()?;
    let mut off = 0usize;
    for d in 0..world {
        let (ns, nr) = (
            counts[rank * world + d] as usize * row,
            counts[d * world + rank] as usize * row,
        );
        if d != rank || with_self {
            let at = |b: &SymmBuffer<u8>| b.device_ptr() as usize + off;
            // SAFETY: both ranges lie inside send/recv (checked above).
            unsafe {
                nc::send(at(send) as *const c_void, ns, ncclUint8, d, raw, cs)?;
                nc::recv(at(recv) as *mut c_void, nr, ncclUint8, d, raw, cs)?;
            }
        }
        off += ns.max(nr);
    }
    nc::group_end()
}

/// The start line of a timed run: [`StartGate::enqueue`] makes the stream
/// wait at a host-mapped word (closed until [`StartGate::open`]) and then,
/// on an NCCL communicator, pass a one-word all-reduce that every rank's GPU
/// leaves together, so host skew and host enqueue time stay out of what is
/// timed after it. On virtual ranks there is no all-reduce: the caller lines
/// the ranks up on the host before it opens the gates.
pub struct StartGate {
    gate: MappedHost<u32>,
    opened: std::cell::Cell<u32>,
    word: CudaSlice<u32>,
}

impl StartGate {
    /// A closed gate for `stream`'s context.
    pub fn new(stream: &Arc<CudaStream>) -> Result<StartGate> {
        Ok(StartGate {
            gate: MappedHost::new(stream.context(), 0u32)?,
            opened: std::cell::Cell::new(0),
            word: stream
                .alloc_zeros::<u32>(1)
                .map_err(Error::cuda("cuMemAllocAsync"))?,
        })
    }

    /// Enqueues the wait at the gate and, on an NCCL communicator, the
    /// one-word all-reduce. Open the gate afterwards whatever happens: a
    /// closed gate blocks the stream.
    pub fn enqueue(&self, comm: &Communicator, stream: &Arc<CudaStream>) -> Result<()> {
        let next = self.opened.get().wrapping_add(1);
        // SAFETY: the gate is a live mapped allocation; flags 0 = wait until
        // the word is >= next (CU_STREAM_WAIT_VALUE_GEQ).
        let rc = unsafe {
            cudarc::driver::sys::cuStreamWaitValue32_v2(
                stream.cu_stream(),
                self.gate.device_ptr(),
                next,
                0,
            )
        };
        if rc != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Cuda {
                context: "cuStreamWaitValue32",
                source: cudarc::driver::DriverError(rc),
            });
        }
        let Some(raw) = comm.raw() else {
            return Ok(());
        };
        let w = DeviceRegion::device_ptr(&self.word) as *mut c_void;
        // SAFETY: one u32 in place, on this rank's stream and communicator.
        unsafe {
            nc::all_reduce(
                w,
                w,
                1,
                ncclUint32,
                ncclSum,
                raw,
                stream.cu_stream() as *mut c_void,
            )
        }
    }

    /// Opens the gate enqueued last.
    pub fn open(&self) {
        let next = self.opened.get().wrapping_add(1);
        self.gate.write(next);
        self.opened.set(next);
    }
}
