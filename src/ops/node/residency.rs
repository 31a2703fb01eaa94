//! Residency: the ranks of a group wait for each other inside kernels, so
//! every block of every rank that shares one GPU (the ranks of a virtual
//! world) must be able to be resident at once, or the first ones spin until
//! their timeout waiting for blocks that cannot start.
//!
//! The rule: with `m` the fewest blocks of any of the group's kernels that
//! one SM holds at once (registers, shared memory, threads), every block
//! takes at most `1/m` of an SM, so any `m` blocks of any kernels fit one SM
//! together. Each rank drives its kernels on one stream, one kernel at a
//! time, so at most `ranks_per_gpu` kernels are in flight; if
//! `ranks_per_gpu * num_sms <= sms * m`, a block that is not yet resident
//! always finds an SM with a free slot.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ops::abi::THREADS;
use crate::runtime::{Communicator, Function};

/// What one GPU holds of a group's kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Residency {
    /// SMs of the GPU.
    pub sms: usize,
    /// Fewest blocks of any of the group's kernels one SM holds at once.
    pub blocks_per_sm: usize,
    /// The kernel that sets `blocks_per_sm`.
    pub kernel: &'static str,
    /// Ranks that share the GPU (the world of a virtual world, else 1).
    pub ranks_per_gpu: usize,
}

impl Residency {
    /// The largest `GroupConfig::num_sms` (blocks per kernel and rank) for
    /// which every rank's blocks fit the GPU at once.
    pub fn max_blocks_per_rank(&self) -> usize {
        self.sms * self.blocks_per_sm / self.ranks_per_gpu.max(1)
    }

    /// Refuses a `num_sms` whose blocks cannot all be resident, saying what fits.
    pub fn check(&self, num_sms: usize) -> Result<()> {
        let fit = self.max_blocks_per_rank();
        if num_sms <= fit {
            return Ok(());
        }
        let who = if self.ranks_per_gpu > 1 {
            format!(
                "{} ranks share this GPU and every rank's blocks must be resident together: {} x {num_sms} = {} blocks",
                self.ranks_per_gpu,
                self.ranks_per_gpu,
                self.ranks_per_gpu * num_sms
            )
        } else {
            format!("every block must be resident at once: {num_sms} blocks")
        };
        Err(Error::arg(
            "num_sms",
            format!(
                "at most {fit} blocks per rank ({who}, but the GPU's {} SMs hold {} block(s) of {} each, {} in all)",
                self.sms,
                self.blocks_per_sm,
                self.kernel,
                self.sms * self.blocks_per_sm
            ),
            num_sms,
        ))
    }
}

/// The residency of `kernels` (each with its dynamic shared memory) on the
/// GPU of `comm`.
pub(crate) fn measure(comm: &Communicator, kernels: &[(&Function, u32)]) -> Result<Residency> {
    // The occupancy queries need the context current on this thread.
    comm.context()
        .bind_to_thread()
        .map_err(Error::cuda("cuCtxSetCurrent"))?;
    let sms = comm
        .context()
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(Error::cuda("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))?
        .max(0) as usize;
    // Every kernel is sized at THREADS per block, the layout scan's blocks
    // too (SCAN_THREADS: the same number, held here).
    const _: () = assert!(crate::ops::abi::SCAN_THREADS == THREADS);
    let mut least: Option<(usize, &'static str)> = None;
    for (f, smem) in kernels {
        let n = f.max_blocks_per_sm(THREADS, *smem)?;
        if least.is_none_or(|(m, _)| n < m) {
            least = Some((n, f.name));
        }
    }
    let (blocks_per_sm, kernel) = least.unwrap_or((1, "none"));
    Ok(Residency {
        sms,
        blocks_per_sm,
        kernel,
        ranks_per_gpu: comm.ranks_per_gpu(),
    })
}

/// What the GPU of `comm` holds of an `NodeGroup`'s kernels for
/// `num_experts` experts: [`Residency::max_blocks_per_rank`] is the largest
/// `GroupConfig::num_sms` that `NodeGroup::new` accepts there (16 for 8
/// virtual ranks on one H200), for a group of either mode (the
/// low-latency kernels are counted too).
pub fn residency(comm: &Arc<Communicator>, num_experts: usize) -> Result<Residency> {
    let k = super::kernels::Kernels::load(comm, crate::ops::config::Mode::LowLatency)?;
    measure(comm, &k.with_smem(num_experts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(ranks: usize, bps: usize) -> Residency {
        Residency {
            sms: 132,
            blocks_per_sm: bps,
            kernel: "moe_ep_combine_push_rank_major_r8",
            ranks_per_gpu: ranks,
        }
    }

    #[test]
    fn what_fits_one_h200() {
        assert_eq!(r(1, 1).max_blocks_per_rank(), 132);
        assert_eq!(r(2, 1).max_blocks_per_rank(), 66);
        assert_eq!(r(4, 1).max_blocks_per_rank(), 33);
        assert_eq!(r(8, 1).max_blocks_per_rank(), 16);
        assert_eq!(r(8, 2).max_blocks_per_rank(), 33);
        assert_eq!(r(3, 1).max_blocks_per_rank(), 44);
        r(8, 1).check(16).unwrap();
        r(1, 1).check(132).unwrap();
        let e = r(8, 1).check(17).unwrap_err();
        match &e {
            Error::InvalidArgument { arg, expected, got } => {
                assert_eq!(*arg, "num_sms");
                assert_eq!(got, "17");
                assert!(expected.contains("at most 16"), "{expected}");
                assert!(expected.contains("8 x 17 = 136"), "{expected}");
                assert!(
                    expected.contains("moe_ep_combine_push_rank_major_r8"),
                    "{expected}"
                );
            }
            other => panic!("{other:?}"),
        }
        let e = r(1, 1).check(133).unwrap_err().to_string();
        assert!(e.contains("at most 132"), "{e}");
    }
}
