//! Device memory one rank holds for a case, moe-ep's beside NCCL EP's
//! (rendered by [`crate::report`]; measured by [`crate::gpu`] and
//! [`crate::nccl_ep`]).
//!
//! moe-ep reports its own: the group's categories
//! ([`moe_ep::MemoryFootprint`], read right after `EpGroup::new`, before
//! any receive buffer or handle is taken from its pool) and the handle's
//! bytes ([`moe_ep::Handle::device_bytes`], after the layout), and the
//! pool's bytes in use while a dispatch of the case holds its outputs (what
//! a pool sized to the case would hold: `MoeEpMemory::sized_to_case`). NCCL EP
//! 0.2.0 has a query for a handle's routing buffers (`ncclEpHandleMemSize`)
//! but none for a group's (its header: "a way to query the required size
//! is planned"), so its group is measured: the device's free memory
//! (`cuMemGetInfo`) before and after `ncclEpCreateGroup`, and likewise
//! around `ncclEpInitHandle` (where it may size buffers of the group
//! lazily). A measured figure counts whole allocations as the driver
//! made them (rounded up to its pages, 2 MiB), and anything else the
//! process allocated on the GPU meanwhile (nothing: ep-bench's rank
//! thread is the only one on its GPU then, and the context is drained
//! first). Tokens and outputs are the caller's in both libraries and are
//! counted in neither; ep-bench takes moe-ep's receive buffers from its
//! pool, where `pool_in_use` counts them.

use serde::Serialize;

/// moe-ep's memory on one rank, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MoeEpMemory {
    /// The symmetric workspace (`MemoryFootprint::workspace`).
    pub workspace: u64,
    /// The low-latency buffer sets (0 in high-throughput mode).
    pub low_latency: u64,
    /// The pool's other segment bytes at creation.
    pub pool_other: u64,
    /// Of `pool_other`, free.
    pub pool_free: u64,
    /// The two-level path's own flags (0 on one node).
    pub two_level: u64,
    /// Pinned host memory (not device memory).
    pub pinned_host: u64,
    /// The case's handle (`Handle::device_bytes`); `None` where there is
    /// none (the low-latency mode makes no handle).
    pub handle: Option<u64>,
    /// The pool's bytes in use while a dispatch of the case holds its
    /// outputs: the receive buffers, the dispatch's ids and sources and
    /// the handle's rows (`pool_other - pool_free` then); what a pool sized
    /// to the case would hold. `None` where not measured.
    pub pool_in_use: Option<u64>,
}

impl MoeEpMemory {
    /// The group's device bytes (`MemoryFootprint::device_total`).
    pub fn group(&self) -> u64 {
        self.workspace + self.low_latency + self.pool_other + self.two_level
    }

    /// Group and handle.
    pub fn device(&self) -> u64 {
        self.group() + self.handle.unwrap_or(0)
    }

    /// The group with its pool sized to the case (`pool_in_use`, which
    /// counts the handle's rows too) and the handle's own arrays: what the
    /// case needs on the device, its receive buffers included; `None` where
    /// the pool's use was not measured.
    pub fn sized_to_case(&self) -> Option<u64> {
        self.pool_in_use.map(|p| {
            self.workspace + self.low_latency + self.two_level + p + self.handle.unwrap_or(0)
        })
    }

    /// The values as one list (the order of [`MoeEpMemory::from_words`]);
    /// `u64::MAX` for no handle or no pool use measured.
    pub fn words(&self) -> [u64; 8] {
        [
            self.workspace,
            self.low_latency,
            self.pool_other,
            self.pool_free,
            self.two_level,
            self.pinned_host,
            self.handle.unwrap_or(u64::MAX),
            self.pool_in_use.unwrap_or(u64::MAX),
        ]
    }

    /// The inverse of [`MoeEpMemory::words`].
    pub fn from_words(w: [u64; 8]) -> Self {
        MoeEpMemory {
            workspace: w[0],
            low_latency: w[1],
            pool_other: w[2],
            pool_free: w[3],
            two_level: w[4],
            pinned_host: w[5],
            handle: (w[6] != u64::MAX).then_some(w[6]),
            pool_in_use: (w[7] != u64::MAX).then_some(w[7]),
        }
    }
}

/// NCCL EP's memory on one rank for the same case, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NcclEpMemory {
    /// Device memory `ncclEpCreateGroup` took (`cuMemGetInfo` before and after).
    pub group_measured: u64,
    /// `ncclEpHandleMemSize` of the handle (its routing buffers); `None`
    /// where the library lacks the query or refuses it.
    pub handle_queried: Option<u64>,
    /// Device memory `ncclEpInitHandle` took (`cuMemGetInfo` before and after).
    pub init_handle_measured: u64,
}

impl NcclEpMemory {
    /// Everything its group and handle creation took on the device.
    pub fn device(&self) -> u64 {
        self.group_measured + self.init_handle_measured
    }

    /// The values as one list (the order of [`NcclEpMemory::from_words`]);
    /// `u64::MAX` for no query.
    pub fn words(&self) -> [u64; 3] {
        [
            self.group_measured,
            self.handle_queried.unwrap_or(u64::MAX),
            self.init_handle_measured,
        ]
    }

    /// The inverse of [`NcclEpMemory::words`].
    pub fn from_words(w: [u64; 3]) -> Self {
        NcclEpMemory {
            group_measured: w[0],
            handle_queried: (w[1] != u64::MAX).then_some(w[1]),
            init_handle_measured: w[2],
        }
    }
}

/// The memory of one case: each field the largest over the ranks (the
/// ranks' routings differ, so their handles do).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Memory {
    /// moe-ep's.
    pub moe_ep: MoeEpMemory,
    /// NCCL EP's, where it ran beside ours on every rank.
    pub nccl_ep: Option<NcclEpMemory>,
}

impl Memory {
    /// The largest of every field over `ranks` (`None` handle or NCCL EP
    /// figures on any rank make `None`).
    pub fn largest(ranks: &[Memory]) -> Option<Memory> {
        let first = ranks.first()?;
        let mut m = *first;
        for r in &ranks[1..] {
            let (a, b) = (m.moe_ep.words(), r.moe_ep.words());
            let mut w: [u64; 8] = std::array::from_fn(|i| a[i].max(b[i]));
            // No handle (or pool use) on one rank: none.
            if m.moe_ep.handle.is_none() || r.moe_ep.handle.is_none() {
                w[6] = u64::MAX;
            }
            if m.moe_ep.pool_in_use.is_none() || r.moe_ep.pool_in_use.is_none() {
                w[7] = u64::MAX;
            }
            m.moe_ep = MoeEpMemory::from_words(w);
            m.nccl_ep = match (m.nccl_ep, r.nccl_ep) {
                (Some(x), Some(y)) => Some(NcclEpMemory {
                    group_measured: x.group_measured.max(y.group_measured),
                    handle_queried: x
                        .handle_queried
                        .zip(y.handle_queried)
                        .map(|(p, q)| p.max(q)),
                    init_handle_measured: x.init_handle_measured.max(y.init_handle_measured),
                }),
                _ => None,
            };
        }
        Some(m)
    }

    /// This rank's values as words for an all-gather: moe-ep's 8, a
    /// presence word and NCCL EP's 3 ([`Memory::from_words`]).
    pub fn words(&self) -> [u64; 12] {
        let mut w = [0u64; 12];
        w[..8].copy_from_slice(&self.moe_ep.words());
        if let Some(n) = &self.nccl_ep {
            w[8] = 1;
            w[9..].copy_from_slice(&n.words());
        }
        w
    }

    /// The inverse of [`Memory::words`].
    pub fn from_words(w: &[u64; 12]) -> Self {
        let mut m = [0u64; 8];
        m.copy_from_slice(&w[..8]);
        let mut n = [0u64; 3];
        n.copy_from_slice(&w[9..]);
        Memory {
            moe_ep: MoeEpMemory::from_words(m),
            nccl_ep: (w[8] == 1).then(|| NcclEpMemory::from_words(n)),
        }
    }
}

/// Bytes as MiB (2^20 B) with two decimals.
pub fn mib(bytes: u64) -> String {
    format!("{:.2}", bytes as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours(handle: Option<u64>) -> MoeEpMemory {
        MoeEpMemory {
            workspace: 100,
            low_latency: 0,
            pool_other: 20,
            pool_free: 5,
            two_level: 3,
            pinned_host: 64,
            handle,
            pool_in_use: handle.map(|h| h + 11),
        }
    }

    #[test]
    fn totals_and_words() {
        let m = ours(Some(7));
        assert_eq!((m.group(), m.device()), (123, 130));
        // workspace 100 + two-level 3 + pool in use 18 + handle 7.
        assert_eq!(m.sized_to_case(), Some(128));
        assert_eq!(ours(None).sized_to_case(), None);
        assert_eq!(MoeEpMemory::from_words(m.words()), m);
        assert_eq!(ours(None).device(), 123);
        assert_eq!(MoeEpMemory::from_words(ours(None).words()), ours(None));
        let n = NcclEpMemory {
            group_measured: 1 << 21,
            handle_queried: None,
            init_handle_measured: 4 << 20,
        };
        assert_eq!(n.device(), 6 << 20);
        assert_eq!(NcclEpMemory::from_words(n.words()), n);
        for mem in [
            Memory {
                moe_ep: m,
                nccl_ep: Some(n),
            },
            Memory {
                moe_ep: ours(None),
                nccl_ep: None,
            },
        ] {
            assert_eq!(Memory::from_words(&mem.words()), mem);
        }
        assert_eq!(mib(3 << 19), "1.50");
    }

    #[test]
    fn largest_over_ranks() {
        let n = |g: u64, h: Option<u64>| NcclEpMemory {
            group_measured: g,
            handle_queried: h,
            init_handle_measured: g / 2,
        };
        let mut r1 = ours(Some(7));
        r1.pool_other = 40;
        let ranks = [
            Memory {
                moe_ep: ours(Some(9)),
                nccl_ep: Some(n(10, Some(3))),
            },
            Memory {
                moe_ep: r1,
                nccl_ep: Some(n(12, Some(2))),
            },
        ];
        let m = Memory::largest(&ranks).unwrap();
        assert_eq!((m.moe_ep.pool_other, m.moe_ep.handle), (40, Some(9)));
        assert_eq!(m.nccl_ep, Some(n(12, Some(3))));
        // NCCL EP missing on one rank, or its query: none.
        let mut part = ranks;
        part[1].nccl_ep = None;
        assert_eq!(Memory::largest(&part).unwrap().nccl_ep, None);
        let mut part = ranks;
        part[0].nccl_ep = Some(n(10, None));
        let q = Memory::largest(&part).unwrap().nccl_ep.unwrap();
        assert_eq!(q.handle_queried, None);
        assert_eq!(Memory::largest(&[]), None);
    }
}
