//! In-process host collectives for the ranks of a virtual world: W ranks in
//! one process, one thread each, meeting at barriers and all-gathers that
//! are bounded by a timeout.
//!
//! Each rank holds one [`HostGroup`] handle. The n-th collective a rank calls
//! meets the n-th collective of every other rank (as NCCL's collectives do);
//! a rank that does not arrive within the timeout, leaves (its handle is
//! dropped, also while its thread panics) or calls a different collective
//! fails the round on every rank with [`Error::CollectiveFailed`] naming it,
//! and every later collective of the group fails at once: the ranks can no
//! longer agree on which round is which.
//!
//! ```
//! use std::time::Duration;
//! use moe_ep::runtime::HostGroup;
//!
//! let ranks = HostGroup::new(3, Duration::from_secs(5));
//! std::thread::scope(|s| {
//!     for g in &ranks {
//!         s.spawn(move || {
//!             let all = g.all_gather("ids", &[g.rank() as u32 * 10]).unwrap();
//!             assert_eq!(all, vec![0, 10, 20]);
//!             g.barrier().unwrap();
//!         });
//!     }
//! });
//! ```

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// One rank's handle on an in-process group of ranks.
pub struct HostGroup {
    shared: Arc<Shared>,
    rank: usize,
    /// Collectives this rank has entered so far (the next round's number).
    rounds: AtomicU64,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

#[derive(Default)]
struct State {
    rounds: BTreeMap<u64, Round>,
    /// `left[r]`: why rank r left the group, once it has.
    left: Vec<Option<&'static str>>,
    /// Set by the first failure; every later collective fails with it.
    broken: Option<(Vec<usize>, String)>,
}

struct Round {
    collective: &'static str,
    values: Vec<Option<Arc<dyn Any + Send + Sync>>>,
    /// Ranks that have not yet taken the result.
    readers_left: usize,
}

impl HostGroup {
    /// A group of `world` ranks whose collectives wait at most `timeout`
    /// for the slowest rank; the handles are in rank order.
    pub fn new(world: usize, timeout: Duration) -> Vec<HostGroup> {
        let shared = Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State {
                left: vec![None; world],
                ..State::default()
            }),
            wake: Condvar::new(),
        });
        (0..world)
            .map(|rank| HostGroup {
                shared: shared.clone(),
                rank,
                rounds: AtomicU64::new(0),
            })
            .collect()
    }

    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.shared.world
    }
    /// How long a collective waits for the slowest rank.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    /// Every rank's `value` (the same length on every rank), in rank order.
    /// `collective` names the call in errors ("barrier", "segment
    /// allocation", ...); every rank must call the same one.
    pub fn all_gather<T: Copy + Send + Sync + 'static>(
        &self,
        collective: &'static str,
        value: &[T],
    ) -> Result<Vec<T>> {
        let all = self.exchange(collective, value.to_vec())?;
        if let Some((r, v)) = all.iter().enumerate().find(|(_, v)| v.len() != value.len()) {
            return Err(self.fail(
                collective,
                vec![r],
                format!(
                    "rank {r} gave {} elements, rank {} gave {}",
                    v.len(),
                    self.rank,
                    value.len()
                ),
            ));
        }
        Ok(all.into_iter().flatten().collect())
    }

    /// The ranks that give the same `color` as a group of their own, in rank
    /// order, with this group's timeout (collective: every rank calls it).
    /// The lowest rank of each color makes its group's handles; the others
    /// take theirs from it through one exchange.
    pub fn split(&self, color: usize) -> Result<HostGroup> {
        type Handles = Arc<Mutex<Vec<Option<HostGroup>>>>;
        let colors = self.all_gather("split (colors)", &[color])?;
        let members: Vec<usize> = (0..colors.len()).filter(|&r| colors[r] == color).collect();
        let made: Option<Handles> = (members[0] == self.rank).then(|| {
            let handles = HostGroup::new(members.len(), self.timeout());
            Arc::new(Mutex::new(handles.into_iter().map(Some).collect()))
        });
        let all = self.exchange("split (groups)", made)?;
        let me = members.iter().position(|&r| r == self.rank);
        let handles = all[members[0]].as_ref();
        match (handles, me) {
            (Some(h), Some(me)) => h.lock().unwrap_or_else(|p| p.into_inner())[me]
                .take()
                .ok_or_else(|| {
                    Error::InvalidState(format!("split: rank {} joined twice", self.rank))
                }),
            _ => Err(Error::InvalidState(format!(
                "split: no group for color {color} on rank {}",
                self.rank
            ))),
        }
    }

    /// Waits until every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        self.exchange("barrier", ()).map(drop)
    }

    /// Every rank's `value`, in rank order: the general form of
    /// [`HostGroup::all_gather`] (values are moved, not copied as bytes, so
    /// they can be owning handles).
    pub fn exchange<T: Clone + Send + Sync + 'static>(
        &self,
        collective: &'static str,
        value: T,
    ) -> Result<Vec<T>> {
        let n = self.rounds.fetch_add(1, Ordering::Relaxed);
        let sh = &*self.shared;
        let timeout = sh.timeout;
        let deadline = Instant::now() + timeout;
        let mut st = sh.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((missing, why)) = &st.broken {
            return Err(self.error(collective, missing.clone(), why.clone()));
        }
        let world = sh.world;
        let round = st.rounds.entry(n).or_insert_with(|| Round {
            collective,
            values: vec![None; world],
            readers_left: world,
        });
        if round.collective != collective {
            let first = round
                .values
                .iter()
                .position(Option::is_some)
                .unwrap_or(self.rank);
            let why = format!(
                "rank {first} called `{}` where rank {} called `{collective}` (every rank must make the same collective calls in the same order)",
                round.collective, self.rank
            );
            return Err(self.break_group(&mut st, collective, vec![first], why));
        }
        round.values[self.rank] = Some(Arc::new(value));
        sh.wake.notify_all();
        loop {
            if let Some((missing, why)) = &st.broken {
                return Err(self.error(collective, missing.clone(), why.clone()));
            }
            let round = st
                .rounds
                .get_mut(&n)
                .expect("a round lives until all have read it");
            let missing: Vec<usize> = (0..world).filter(|&r| round.values[r].is_none()).collect();
            if missing.is_empty() {
                let mut out = Vec::with_capacity(world);
                for (r, v) in round.values.iter().enumerate() {
                    let v = v.as_ref().expect("every rank arrived");
                    match v.downcast_ref::<T>() {
                        Some(t) => out.push(t.clone()),
                        None => {
                            let why = format!(
                                "rank {r} passed another kind of value to `{collective}` than rank {}",
                                self.rank
                            );
                            return Err(self.break_group(&mut st, collective, vec![r], why));
                        }
                    }
                }
                round.readers_left -= 1;
                if round.readers_left == 0 {
                    st.rounds.remove(&n);
                }
                return Ok(out);
            }
            let gone: Vec<String> = missing
                .iter()
                .filter_map(|&r| st.left[r].map(|how| format!("rank {r} {how}")))
                .collect();
            if !gone.is_empty() {
                let why = format!("{} before arriving", gone.join(", "));
                return Err(self.break_group(&mut st, collective, missing, why));
            }
            let now = Instant::now();
            if now >= deadline {
                let why = format!(
                    "{} did not arrive within {:?}",
                    ranks_text(&missing),
                    timeout
                );
                return Err(self.break_group(&mut st, collective, missing, why));
            }
            st = sh
                .wake
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Fails every pending and later collective of the group (what
    /// `ncclCommAbort` does for NCCL's).
    pub fn abort(&self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        let why = format!("rank {} aborted the group", self.rank);
        self.break_group(&mut st, "abort", vec![self.rank], why);
    }

    fn break_group(
        &self,
        st: &mut State,
        collective: &'static str,
        missing: Vec<usize>,
        why: String,
    ) -> Error {
        if st.broken.is_none() {
            st.broken = Some((missing.clone(), why.clone()));
        }
        self.shared.wake.notify_all();
        self.error(collective, missing, why)
    }

    fn fail(&self, collective: &'static str, missing: Vec<usize>, why: String) -> Error {
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        self.break_group(&mut st, collective, missing, why)
    }

    fn error(&self, collective: &'static str, missing: Vec<usize>, reason: String) -> Error {
        Error::CollectiveFailed {
            rank: self.rank,
            collective,
            missing,
            reason,
        }
    }
}

/// Arrivals of the ranks of a virtual world at the same points of a
/// sequence (each op of one group): [`OpBarrier::arrive`] returns once
/// every rank has arrived as often as this one, or fails naming the ranks
/// that have not, without breaking anything (unlike a [`HostGroup`]
/// collective: later arrivals are counted as before).
///
/// A rank's host may refuse a call ([`OpBarrier::arrive`]'s `refused`).
/// Where every rank refused the same call the ranks are still in step and
/// the arrivals pace them as before; where one refused a call that another
/// made, their programs may part (the refusing rank retries, its peer
/// checks), so neither waits for the other until [`OpBarrier::realign`].
pub struct OpBarrier {
    state: Mutex<Arrivals>,
    wake: Condvar,
}

/// Per rank: arrivals, the arrival at which its host last refused its call
/// (0: none), and the count it was realigned to (refusals at or below it
/// are of before the realignment).
struct Arrivals {
    count: Vec<u64>,
    refused: Vec<u64>,
    since: Vec<u64>,
}

impl Arrivals {
    /// Whether `rank` and a peer parted on a refusal since `rank` was last
    /// realigned: one refused a call the other has made without refusing.
    fn parted(&self, rank: usize) -> bool {
        let base = self.since[rank];
        let fresh = |r: usize| Some(self.refused[r]).filter(|&a| a > base);
        let mine = fresh(rank);
        (0..self.count.len()).any(|p| {
            let theirs = fresh(p);
            theirs != mine
                && (mine.is_some_and(|a| self.count[p] >= a)
                    || theirs.is_some_and(|a| self.count[rank] >= a))
        })
    }
}

impl OpBarrier {
    /// A barrier of `world` ranks, no arrival yet.
    pub fn new(world: usize) -> OpBarrier {
        OpBarrier {
            state: Mutex::new(Arrivals {
                count: vec![0; world],
                refused: vec![0; world],
                since: vec![0; world],
            }),
            wake: Condvar::new(),
        }
    }

    /// Counts `rank`'s next arrival (`refused`: its host refused the call
    /// it arrives from) and waits (at most `timeout`) until every rank has
    /// arrived as often, or until `stop()` (looked at every millisecond)
    /// says the wait is moot, or this rank and a peer parted on a refusal
    /// (see [`OpBarrier`]). `what` names the point in the error.
    pub fn arrive(
        &self,
        rank: usize,
        what: &'static str,
        timeout: Duration,
        refused: bool,
        stop: &dyn Fn() -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut a = self.state.lock().unwrap_or_else(|p| p.into_inner());
        a.count[rank] += 1;
        let target = a.count[rank];
        if refused {
            a.refused[rank] = target;
        }
        self.wake.notify_all();
        loop {
            let missing: Vec<usize> = (0..a.count.len())
                .filter(|&r| a.count[r] < target)
                .collect();
            if missing.is_empty() || a.parted(rank) {
                return Ok(());
            }
            drop(a);
            if stop() {
                return Ok(());
            }
            a = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::CollectiveFailed {
                    rank,
                    collective: what,
                    missing: missing.clone(),
                    reason: format!(
                        "{} did not arrive within {timeout:?} (its {target}th)",
                        ranks_text(&missing)
                    ),
                });
            }
            a = self
                .wake
                .wait_timeout(a, (deadline - now).min(Duration::from_millis(1)))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// How often `rank` has arrived.
    pub fn arrivals(&self, rank: usize) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).count[rank]
    }

    /// Counts `rank` as having arrived `to` times (after an error, when the
    /// ranks made different calls: every rank sets the same count, the most
    /// any rank had, at the same point of its program); refusals up to
    /// then no longer part it from its peers.
    pub fn realign(&self, rank: usize, to: u64) {
        let mut a = self.state.lock().unwrap_or_else(|p| p.into_inner());
        a.count[rank] = to;
        a.since[rank] = to;
        self.wake.notify_all();
    }
}

impl Drop for HostGroup {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        st.left[self.rank] = Some(if std::thread::panicking() {
            "panicked"
        } else {
            "left the group (its handle was dropped)"
        });
        self.shared.wake.notify_all();
    }
}

fn ranks_text(r: &[usize]) -> String {
    let list: Vec<String> = r.iter().map(|x| x.to_string()).collect();
    match r.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<F: Fn(&HostGroup) -> Result<()> + Sync>(world: usize, ms: u64, f: F) -> Vec<Result<()>> {
        let ranks = HostGroup::new(world, Duration::from_millis(ms));
        std::thread::scope(|s| {
            let hs: Vec<_> = ranks.iter().map(|g| s.spawn(|| f(g))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_gather_in_rank_order_many_rounds() {
        let res = run(5, 5000, |g| {
            for round in 0..200u64 {
                let all = g.all_gather("ids", &[g.rank() as u64, round])?;
                let want: Vec<u64> = (0..5).flat_map(|r| [r, round]).collect();
                assert_eq!(all, want);
                if round % 7 == 0 {
                    g.barrier()?;
                }
            }
            Ok(())
        });
        assert!(res.iter().all(|r| r.is_ok()), "{res:?}");
    }

    #[test]
    fn split_groups_run_their_own_rounds_in_rank_order() {
        // 8 ranks into nodes of 4 (color rank / 4) and into rails (rank % 4).
        let res = run(8, 5000, |g| {
            let node = g.split(g.rank() / 4)?;
            let rail = g.split(g.rank() % 4)?;
            assert_eq!((node.world(), node.rank()), (4, g.rank() % 4));
            assert_eq!((rail.world(), rail.rank()), (2, g.rank() / 4));
            for round in 0..20u64 {
                let n = node.all_gather("node ids", &[g.rank() as u64, round])?;
                let first = (g.rank() / 4 * 4) as u64;
                let want: Vec<u64> = (first..first + 4).flat_map(|r| [r, round]).collect();
                assert_eq!(n, want);
                let r = rail.all_gather("rail ids", &[g.rank() as u64])?;
                assert_eq!(r, vec![(g.rank() % 4) as u64, (g.rank() % 4 + 4) as u64]);
            }
            // The parent still works after its splits.
            g.barrier()
        });
        assert!(res.iter().all(|r| r.is_ok()), "{res:?}");
    }

    #[test]
    fn a_split_member_that_leaves_is_named_in_its_group_only() {
        let res = run(4, 300, |g| {
            let node = g.split(g.rank() / 2)?;
            if g.rank() == 3 {
                return Ok(()); // leaves without a collective on its group
            }
            node.barrier()
        });
        assert!(
            res[0].is_ok() && res[1].is_ok() && res[3].is_ok(),
            "{res:?}"
        );
        let e = res[2].as_ref().unwrap_err().to_string();
        assert!(e.contains("rank 1"), "{e}");
    }

    #[test]
    fn missing_rank_is_named_within_the_timeout() {
        let t0 = Instant::now();
        let ranks = HostGroup::new(4, Duration::from_millis(300));
        let res: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .filter(|g| g.rank() != 2)
                .map(|g| s.spawn(|| g.barrier()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        for r in &res {
            match r {
                Err(Error::CollectiveFailed {
                    missing,
                    reason,
                    collective,
                    ..
                }) => {
                    assert_eq!(missing, &vec![2]);
                    assert_eq!(*collective, "barrier");
                    assert!(reason.contains("rank 2 did not arrive"), "{reason}");
                }
                other => panic!("expected CollectiveFailed, got {other:?}"),
            }
        }
        // The group is broken for good: the late rank fails at once too.
        let t1 = Instant::now();
        let e = ranks[2].barrier().unwrap_err();
        assert!(t1.elapsed() < Duration::from_millis(100));
        assert!(e.to_string().contains("rank 2"), "{e}");
    }

    #[test]
    fn dropped_or_panicking_rank_fails_the_others_at_once() {
        let ranks = HostGroup::new(3, Duration::from_secs(30));
        let mut it = ranks.into_iter();
        let (g0, g1, g2) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let t0 = Instant::now();
        let res: Vec<Result<()>> = std::thread::scope(|s| {
            let a = s.spawn(move || g0.barrier());
            let b = s.spawn(move || g1.barrier());
            let c = s.spawn(move || {
                let _g = g2;
                std::thread::sleep(Duration::from_millis(50));
                panic!("rank 2 fails");
            });
            assert!(c.join().is_err());
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        for r in res {
            let e = r.unwrap_err();
            assert!(e.to_string().contains("rank 2 panicked"), "{e}");
        }
    }

    #[test]
    fn different_collectives_or_lengths_fail_by_name() {
        let res = run(2, 2000, |g| {
            if g.rank() == 0 {
                g.barrier()
            } else {
                g.all_gather("segment allocation", &[1u8]).map(drop)
            }
        });
        for r in &res {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(
                e.contains("barrier") && e.contains("segment allocation"),
                "{e}"
            );
        }
        let res = run(2, 2000, |g| {
            g.all_gather("x", &vec![0u32; 1 + g.rank()]).map(drop)
        });
        assert!(res.iter().all(|r| r.is_err()), "{res:?}");
        let e = res[0].as_ref().unwrap_err().to_string();
        assert!(e.contains("elements"), "{e}");
    }

    #[test]
    fn abort_unblocks_a_pending_collective() {
        let ranks = HostGroup::new(2, Duration::from_secs(30));
        let t0 = Instant::now();
        std::thread::scope(|s| {
            let h = s.spawn(|| ranks[0].barrier());
            std::thread::sleep(Duration::from_millis(50));
            ranks[1].abort();
            let e = h.join().unwrap().unwrap_err();
            assert!(e.to_string().contains("aborted"), "{e}");
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
    }

    /// Two ranks through one op barrier: rank 1 arrives `late` after rank
    /// 0 did; returns how long rank 0's arrival took.
    fn op_pair(b: &OpBarrier, refused: [bool; 2], late: Duration) -> Duration {
        let next = b.arrivals(0) + 1;
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                let t0 = Instant::now();
                b.arrive(0, "op", Duration::from_secs(10), refused[0], &|| false)
                    .unwrap();
                t0.elapsed()
            });
            while b.arrivals(0) < next {
                std::thread::sleep(Duration::from_millis(1));
            }
            std::thread::sleep(late);
            b.arrive(1, "op", Duration::from_secs(10), refused[1], &|| false)
                .unwrap();
            h.join().unwrap()
        })
    }

    #[test]
    fn op_barrier_paces_ranks_that_refused_the_same_call() {
        let b = OpBarrier::new(2);
        let late = Duration::from_millis(60);
        assert!(op_pair(&b, [false, false], late) >= late);
        // Both refused call 2: still in step, still paced, then and later.
        assert!(op_pair(&b, [true, true], late) >= late);
        assert!(op_pair(&b, [false, false], late) >= late);
        assert_eq!((b.arrivals(0), b.arrivals(1)), (3, 3));
    }

    #[test]
    fn op_barrier_lets_ranks_part_on_a_refusal_of_one_until_realigned() {
        let b = OpBarrier::new(2);
        let late = Duration::from_millis(200);
        // Rank 1 refused call 1, rank 0 made it: rank 0 does not wait once
        // rank 1 has arrived from it...
        assert!(op_pair(&b, [false, true], Duration::ZERO) < late);
        // ...nor at its next call, where rank 1 (retrying, say) comes late.
        assert!(op_pair(&b, [false, false], late) < late);
        // Rank 1 retried once more than rank 0: realigned to the most,
        // the ranks are paced again.
        b.arrive(1, "op", Duration::from_secs(10), false, &|| false)
            .unwrap();
        b.realign(0, 3);
        b.realign(1, 3);
        assert!(op_pair(&b, [false, false], late) >= late);
        // The same with rank 0 the one that refused.
        let b = OpBarrier::new(2);
        assert!(op_pair(&b, [true, false], Duration::ZERO) < late);
        assert!(op_pair(&b, [false, false], late) < late);
    }

    #[test]
    fn op_barrier_waits_for_a_peer_that_has_not_reached_the_refused_call() {
        // Rank 0 refused call 1; rank 1 has not made call 1 yet: it may
        // refuse it too, so rank 0 waits for it.
        let b = OpBarrier::new(2);
        let late = Duration::from_millis(60);
        assert!(op_pair(&b, [true, true], late) >= late);
        let e = OpBarrier::new(2)
            .arrive(0, "op", Duration::from_millis(30), true, &|| false)
            .unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
    }
}
