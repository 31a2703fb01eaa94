//! What the device found, as an [`Error`]: the one-node group's
//! [`check`](NodeGroup::check) (the ranks meet and agree on where the next
//! call starts), the error an earlier call left ([`NodeGroup::pending_error`],
//! refused at every op's entry), and the decoding of the kernels' status
//! words and error report (`ErrorInfo`, `kernels-cuda/abi.cuh`;
//! `ErrSink` in `common.cuh`, `Ws::status` in `intranode.cuh`) into an
//! [`Error`], with the debug print of a timeout's peer state.
//!
//! Tests: `tests/gpu_intranode.rs` (a device error reported by the next
//! call; a timeout leaves the group unusable); the unit test below (the
//! debug line).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::group::NodeGroup;
use crate::error::{Error, Result};
use crate::ops::abi::{self, ErrorInfo, MAX_BLOCKS};

impl NodeGroup {
    /// The one-node path of [`EpGroup::check`](crate::EpGroup::check).
    pub fn check(&self) -> Result<()> {
        if self.comm.is_aborted() {
            return Err(Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new communicator and group",
                self.comm.rank()
            )));
        }
        let mut turns = self.turns.lock().unwrap_or_else(|p| p.into_inner());
        // Every op of the group is ordered after the previous one (turn):
        // the last stream's end is the end of all of them.
        let stream = turns
            .last
            .clone()
            .unwrap_or_else(|| self.own_stream.clone());
        self.bind(&stream)?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        let dev = self.error.read();
        if self.poisoned.load(Ordering::Relaxed) || timed_out(&dev) {
            // Dead here: no collective (the rank that did not come may never
            // call check), and nothing more runs on the group.
            self.poisoned.store(true, Ordering::Relaxed);
            return Err(if timed_out(&dev) {
                self.print_peer_state(&dev);
                self.error_of(dev)
            } else {
                Self::poisoned_error()
            });
        }
        if !turns.unchecked {
            // No op since the last check that met the other ranks: nothing
            // new to learn, and no collective (a program may check twice).
            return Ok(());
        }
        // 0: nothing; 1: an error (what the kernels found: a refusal of
        // this rank's host alone is found by its peers' kernels, unless every
        // rank refused that call, which leaves nothing out of step).
        let found = u64::from(dev.code != abi::code::OK);
        let ll_seq = match &self.ll {
            Some(ll) => ll.batches_sent(&stream)?,
            None => 0,
        };
        let calls = self.device_calls(&stream)?;
        let arrived = self
            .op_barrier
            .as_ref()
            .map_or(0, |b| b.arrivals(self.comm.rank()));
        // Each rank's own report goes along: a rank whose kernels only saw
        // a peer stop returns the error of the rank that found it.
        let mine = [
            found,
            turns.calls,
            ll_seq,
            calls,
            arrived,
            dev.code as u32 as u64,
            dev.rank as u32 as u64,
            dev.peer as u32 as u64,
            dev.counter as u32 as u64,
            dev.expected,
            dev.seen,
            dev.needed,
            dev.capacity,
        ];
        let all = self.comm.all_gather_host(&stream, &mine)?;
        let world = self.comm.world();
        let n = mine.len();
        let row = |r: usize| &all[n * r..n * r + n];
        let report = |r: usize| {
            let w = row(r);
            ErrorInfo {
                code: w[5] as u32 as i32,
                rank: w[6] as u32 as i32,
                peer: w[7] as u32 as i32,
                counter: w[8] as u32 as i32,
                expected: w[9],
                seen: w[10],
                needed: w[11],
                capacity: w[12],
                ..ErrorInfo::default()
            }
        };
        // An error a rank's kernels found themselves, not a peer's stop.
        let primary = |e: &ErrorInfo| !matches!(e.code, abi::code::OK | abi::code::PEER_STOPPED);
        let worst = (0..world).map(|r| row(r)[0]).max().unwrap_or(0);
        turns.unchecked = false;
        if worst == 0 {
            turns.refused = None;
            return Ok(());
        }
        // Past the all-gather every rank's kernels of the calls so far are
        // done (each rank waited for its stream first): only now is this
        // rank's status word cleared, since a peer's kernel still waiting
        // for this rank ends on that word (peer_stopped in intranode.cuh;
        // cleared before the gather, a peer slower to look waited to its
        // timeout: fault_peer_row_out_of_range_on_one_rank at virtual world
        // 4, one H100, 2026-12-07). The ranks meet once more, so that no
        // rank's next kernel reads a word not cleared yet.
        if found != 0 {
            self.clear_device_error(&stream)?;
            self.error.write(ErrorInfo::default());
        }
        self.comm.all_gather_host(&stream, &[0u64])?;
        // This rank's own error first, else the first rank's that found one.
        // Where its kernels only saw a peer stop, the PeerFailed naming that
        // peer carries the argument of that peer's own error (ranks that
        // disagree, a bad value): every rank names the root and what was
        // wrong.
        let own: Option<Error> =
            if dev.code == abi::code::PEER_STOPPED && dev.seen != abi::code::TIMEOUT as u64 {
                let named = dev.peer as usize;
                let root_arg = (named < world && primary(&report(named)))
                    .then(|| match self.error_of(report(named)) {
                        Error::InvalidArgument { arg, .. }
                        | Error::InvalidDeviceData { arg, .. } => Some(arg),
                        Error::PeerFailed { arg, .. } => arg,
                        _ => None,
                    })
                    .flatten();
                Some(match self.error_of(dev) {
                    Error::PeerFailed { peer, arg, reason } => Error::PeerFailed {
                        peer,
                        arg: arg.or(root_arg),
                        reason,
                    },
                    other => other,
                })
            } else if dev.code != abi::code::OK {
                Some(self.error_of(dev))
            } else {
                turns.refused.clone().map(Error::InvalidState)
            };
        let peer_error = || Error::PeerFailed {
            peer: (0..world).find(|&r| row(r)[0] != 0).unwrap_or(0),
            arg: None,
            reason: "reported an error since the last check (its own check says which)".into(),
        };
        // Every rank agrees on where the next call starts, its kernels run
        // again, and its low-latency sets take new batches.
        turns.calls = (0..world).map(|r| row(r)[1]).max().unwrap_or(turns.calls);
        if let Some(b) = &self.op_barrier {
            b.realign(
                self.comm.rank(),
                (0..world).map(|r| row(r)[4]).max().unwrap_or(arrived),
            );
        }
        self.set_device_calls(
            &stream,
            (0..world).map(|r| row(r)[3]).max().unwrap_or(calls),
        )?;
        turns.refused = None;
        turns.epoch += 1;
        if let Some(ll) = &self.ll {
            let sent = (0..world).map(|r| row(r)[2]).max().unwrap_or(0);
            ll.realign(&stream, sent)?;
        }
        Err(own.unwrap_or_else(peer_error))
    }

    /// The error an earlier call left, if any, without clearing it: what an
    /// op refuses with at entry (every rank found it in the same call, or
    /// this rank's host refused one, which its peers found).
    pub(crate) fn pending_error(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Relaxed) {
            return Err(Self::poisoned_error());
        }
        let e = self.error.read();
        match e.code {
            abi::code::OK => {}
            _ if timed_out(&e) => {
                // A timeout poisons the group at once.
                self.poisoned.store(true, Ordering::Relaxed);
                self.print_peer_state(&e);
                return Err(self.error_of(e));
            }
            _ => return Err(self.error_of(e)),
        }
        // A refusal of this rank's host alone stops nothing here: where the
        // peers took part in the call their kernels found it, and this
        // rank's next call meets them stopped; where every rank refused
        // the same call, nothing is out of step.
        Ok(())
    }

    fn poisoned_error() -> Error {
        Error::InvalidState(
            "an earlier peer timeout left this group unusable; create a new one".into(),
        )
    }

    /// The calls this rank's kernels have counted (Ws::seq(4), block 0's;
    /// every block's moves in step), read after `stream`'s work.
    fn device_calls(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        let at = self.ws_peers[self.comm.rank()] + self.w.seq_off + 4 * MAX_BLOCKS as u64 * 8;
        let mut v = [0u64; 1];
        // SAFETY: one word of the seq region; no kernel of the group runs.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut v, at, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemcpyDtoHAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))?;
        Ok(v[0])
    }

    /// Sets every block's count of the group's calls to `calls` (the most
    /// any rank counted, at `check`): the next call has the same number on
    /// every rank, above any a peer's flag or descriptor still holds.
    fn set_device_calls(&self, stream: &Arc<CudaStream>, calls: u64) -> Result<()> {
        let at = self.ws_peers[self.comm.rank()] + self.w.seq_off + 4 * MAX_BLOCKS as u64 * 8;
        let v = vec![calls; MAX_BLOCKS];
        // SAFETY: the seq region's row 4; no kernel of the group runs.
        unsafe { cudarc::driver::result::memcpy_htod_async(at, &v, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemcpyHtoDAsync"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))
    }

    /// Clears, on `stream` (after the work on it), the device-side claim
    /// word (ErrSink in common.cuh), the item counters and the status word
    /// that stops the kernels (Ws::status in intranode.cuh): seq region
    /// `[3][0..10)`; then waits for it.
    fn clear_device_error(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let words = self.ws_peers[self.comm.rank()] + self.w.seq_off + 3 * MAX_BLOCKS as u64 * 8;
        // SAFETY: the ten words lie inside the workspace (seq region [3]);
        // no kernel of this group runs once `stream`, the last op's, is done
        // with what was enqueued before the memset.
        unsafe { cudarc::driver::result::memset_d8_async(words, 0, 10 * 8, stream.cu_stream()) }
            .map_err(Error::cuda("cuMemsetD8Async"))?;
        stream
            .synchronize()
            .map_err(Error::cuda("cuStreamSynchronize"))
    }

    /// With `MOE_EP_DEBUG_PEERS=1`, a timeout also logs (warn level, through
    /// `tracing`) the words of this rank's and the named peer's workspaces that keep the
    /// ranks in step ([`peer_state_line`]), read while they stand (the
    /// peer's kernels may still run). Off, it does nothing.
    fn print_peer_state(&self, e: &ErrorInfo) {
        if std::env::var_os("MOE_EP_DEBUG_PEERS").is_none_or(|v| v != "1") {
            return;
        }
        let me = self.comm.rank();
        let mut ranks = vec![me];
        if (e.peer as usize) < self.comm.world() && e.peer as usize != me {
            ranks.push(e.peer as usize);
        }
        for r in ranks {
            let mut words = vec![0u64; 5 * MAX_BLOCKS];
            let base = self.ws_peers[r];
            // SAFETY: the seq region ([5][MAX_BLOCKS] u64 at seq_off) lies
            // inside rank r's workspace as mapped here; reading it races only
            // with its kernels' own updates, which a debug print tolerates.
            let read = (base != 0)
                .then(|| unsafe {
                    cudarc::driver::result::memcpy_dtoh_sync(&mut words, base + self.w.seq_off)
                })
                .transpose();
            match read {
                Ok(Some(())) => tracing::warn!(
                    "rank {me}, after a timeout ({}): {}",
                    abi::counter_name(e.counter),
                    peer_state_line(r, &words, self.cfg.num_sms)
                ),
                Ok(None) => tracing::warn!("rank {me}: rank {r}'s workspace is not mapped here"),
                Err(err) => tracing::warn!("rank {me}: rank {r}'s workspace unreadable: {err}"),
            }
        }
    }

    /// The error a device report stands for.
    fn error_of(&self, e: ErrorInfo) -> Error {
        let who = |peer: i32| {
            if peer as usize == self.comm.rank() {
                format!("rank {peer} (this rank)")
            } else {
                format!("rank {peer}")
            }
        };
        match e.code {
            abi::code::TIMEOUT => Error::PeerTimeout {
                rank: e.rank as usize,
                peer: e.peer as usize,
                counter: abi::counter_name(e.counter),
                expected: e.expected,
                seen: e.seen,
                absent: e.needed == 1,
            },
            abi::code::REFUSED => {
                let arg = (e.counter > 0).then(|| abi::arg_name(e.counter as u64));
                Error::PeerFailed {
                    peer: e.peer as usize,
                    arg,
                    reason: format!(
                        "its host refused its part of call {}{}{} (its own error says why)",
                        e.capacity,
                        match e.seen {
                            0 => String::new(),
                            op => format!(" ({})", abi::desc::op_name(op)),
                        },
                        arg.map_or(String::new(), |a| format!(": argument `{a}`")),
                    ),
                }
            }
            abi::code::PEER_STOPPED if e.seen == abi::code::TIMEOUT as u64 => Error::PeerTimeout {
                rank: e.rank as usize,
                peer: e.peer as usize,
                counter: "another rank's wait for it (that rank timed out first)",
                expected: 0,
                seen: 0,
                absent: false,
            },
            abi::code::PEER_STOPPED => Error::PeerFailed {
                peer: e.peer as usize,
                arg: None,
                reason: format!(
                    "it skipped call {} after an error of its own{}; call check() on every rank",
                    e.capacity,
                    match e.seen {
                        0 => String::new(),
                        c => format!(" (code {c}: {})", abi::code_name(c as i32)),
                    }
                ),
            },
            abi::code::BAD_PEER_DATA => {
                let by = if e.peer >= 0 {
                    who(e.peer)
                } else {
                    "a peer".to_string()
                };
                Error::InvalidDeviceData {
                    arg: abi::field_name(e.counter),
                    detail: match e.counter {
                        abi::FIELD_META_REPEATED => format!(
                            "{by} wrote row {} twice for one token (received token {}); nothing was read there",
                            e.seen as i64, e.needed
                        ),
                        abi::FIELD_SUBCHUNK_STARTS => format!(
                            "{by} wrote {} at word {} of its count row, where each sub-chunk start must be at least the one before and at most its {} rows for that rank; nothing was read or written there",
                            e.seen as i64, e.needed, e.expected
                        ),
                        abi::FIELD_BAD_ENTRY => format!(
                            "{by} reported a first bad topk_idx entry {:#x} that names no error; nothing was read there",
                            e.seen
                        ),
                        _ => format!(
                            "{by} wrote {} where only values below {} fit (at {}); nothing was read or written there",
                            e.seen as i64, e.expected, e.needed
                        ),
                    },
                }
            }
            abi::code::ABORTED => Error::InvalidState(format!(
                "rank {}: the communicator was aborted; make a new communicator and group",
                self.comm.rank()
            )),
            abi::code::MISMATCH if e.counter == abi::desc::FIELD_HANDLE => Error::arg(
                "handle",
                format!(
                    "the same handle (the same layout call) on every rank at once (rank {} uses the handle of call {})",
                    e.peer, e.seen
                ),
                format!("the handle of call {} on rank {}", e.expected, self.comm.rank()),
            ),
            abi::code::CAPACITY => Error::CapacityExceeded {
                what: if e.peer as usize == self.comm.rank() {
                    "recv_capacity (this rank)"
                } else {
                    "recv_capacity (a peer rank)"
                },
                needed: e.needed as usize,
                capacity: e.capacity as usize,
            },
            abi::code::BAD_EXPERT => Error::InvalidDeviceData {
                arg: "topk_idx",
                detail: format!(
                    "{}: token {} slot {}: expert id {} not in [-1, {})",
                    who(e.peer),
                    e.needed,
                    e.capacity,
                    e.seen as i64,
                    e.expected
                ),
            },
            abi::code::DUP_EXPERT => Error::InvalidDeviceData {
                arg: "topk_idx",
                detail: format!(
                    "{}: token {} slot {}: expert {} appears twice in the token's top-k",
                    who(e.peer),
                    e.needed,
                    e.capacity,
                    e.seen as i64
                ),
            },
            abi::code::MISMATCH
                if e.counter < abi::desc::FIELD_OP || e.counter == abi::FIELD_PAYLOAD =>
            {
                Error::arg(
                    abi::field_name(e.counter),
                    format!(
                        "the same value on every rank in one layout (rank {} has {})",
                        e.peer, e.seen as i64
                    ),
                    format!("{} on rank {}", e.expected as i64, self.comm.rank()),
                )
            }
            abi::code::MISMATCH if e.counter == abi::desc::FIELD_OP => Error::arg(
                "op",
                format!(
                    "the same op on every rank at once (rank {} runs {})",
                    e.peer,
                    abi::desc::op_name(e.seen)
                ),
                format!(
                    "{} on rank {}",
                    abi::desc::op_name(e.expected),
                    self.comm.rank()
                ),
            ),
            abi::code::MISMATCH => Error::arg(
                abi::field_name(e.counter),
                format!(
                    "a buffer of the same kind in the same place on every rank (rank {}: {})",
                    e.peer,
                    abi::desc::place(e.seen)
                ),
                format!(
                    "{} on rank {}",
                    abi::desc::place(e.expected),
                    self.comm.rank()
                ),
            ),
            c => Error::InvalidState(format!("unknown device error code {c}")),
        }
    }
}

/// A report that leaves the group unusable: a timeout here, or a peer that
/// stopped after a timeout of its own (the flags of that call are out of
/// step on some rank).
fn timed_out(e: &ErrorInfo) -> bool {
    e.code == abi::code::TIMEOUT
        || (e.code == abi::code::PEER_STOPPED && e.seen == abi::code::TIMEOUT as u64)
}

/// One rank's step words (`words`: its workspace's `[5][MAX_BLOCKS]` seq
/// region, `Ws::seq` in intranode.cuh), for a timeout's debug print: the
/// group's calls (row 4), the layout calls (row 0, slot 0), the dispatch-family and combine-family
/// calls of its `blocks` blocks (rows 1 and 2: the fewest and the most), the
/// error claim word (row 3, word 0) and the status word that makes every
/// kernel return at entry (row 3, word 8).
fn peer_state_line(rank: usize, words: &[u64], blocks: usize) -> String {
    let blocks = blocks.clamp(1, MAX_BLOCKS);
    let range = |row: usize| {
        let s = &words[row * MAX_BLOCKS..row * MAX_BLOCKS + blocks];
        let (lo, hi) = (s.iter().min().unwrap(), s.iter().max().unwrap());
        if lo == hi {
            format!("{lo}")
        } else {
            format!("{lo}..{hi}")
        }
    };
    format!(
        "rank {rank}'s workspace: calls {} (layout {}, dispatch family {}, combine family {}) over its {blocks} blocks, error word {}, status word {}",
        range(4),
        words[0],
        range(1),
        range(2),
        words[3 * MAX_BLOCKS],
        words[3 * MAX_BLOCKS + 8]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The debug line reads each word where the kernels keep it.
    #[test]
    fn peer_state_line_reads_the_kernels_words() {
        let mut w = vec![0u64; 5 * MAX_BLOCKS];
        w[4 * MAX_BLOCKS..4 * MAX_BLOCKS + 4].fill(15); // the group's calls
        w[0] = 3; // layout calls
        w[MAX_BLOCKS..MAX_BLOCKS + 4].copy_from_slice(&[7, 7, 6, 7]); // dispatch, 4 blocks
        w[MAX_BLOCKS + 4] = 99; // a block past the grid: not counted
        w[2 * MAX_BLOCKS..2 * MAX_BLOCKS + 4].fill(5); // combine
        w[3 * MAX_BLOCKS] = 1; // error claim
        w[3 * MAX_BLOCKS + 8] = 4; // status
        assert_eq!(
            peer_state_line(2, &w, 4),
            "rank 2's workspace: calls 15 (layout 3, dispatch family 6..7, combine family 5) \
             over its 4 blocks, error word 1, status word 4"
        );
        w[3 * MAX_BLOCKS + 8] = 0;
        assert!(peer_state_line(2, &w, 4).ends_with("error word 1, status word 0"));
    }
}
