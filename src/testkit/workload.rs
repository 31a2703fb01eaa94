//! Deterministic workload generators for tests and the benchmark.
//!
//! Everything is derived from a `u64` seed through [`Rng`] (SplitMix64), so a
//! run is reproducible and every rank of a multi-process job can rebuild every
//! other rank's inputs: [`rank_inputs`] seeds rank `r` with
//! [`rank_seed`]`(seed, r)` and draws, in this order, its `topk_idx`
//! ([`topk_idx`]), `topk_weights` ([`topk_weights`]) and `tokens`
//! ([`tokens`]). Rank `r`'s inputs depend only on `(seed, r, T_r, shape,
//! routing)`, not on the other ranks' token counts.

use std::path::Path;

use half::bf16;

use crate::error::{Error, Result};
use crate::reference::{RankInput, Shape};

/// SplitMix64 pseudo-random generator (Steele, Lea & Flood): tiny, fast, and
/// good enough for test data. Not cryptographic.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

/// SplitMix64's output mix.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator seeded with `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    /// The next 64 uniformly random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.state)
    }

    /// Uniform integer in `[0, n)`, unbiased (Lemire's method).
    ///
    /// # Panics
    /// If `n == 0`.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "Rng::below(0)");
        let n = n as u64;
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as usize
    }

    /// Uniform `f32` in `[0, 1)` (24 random bits).
    pub fn f32_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform `f64` in `[0, 1)` (53 random bits).
    pub fn f64_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// Appends `k` distinct integers from `[lo, hi)` to `out`, in random order
    /// (Floyd's algorithm, then a shuffle of the new entries).
    fn distinct(&mut self, lo: usize, hi: usize, k: usize, out: &mut Vec<i64>) {
        let n = hi - lo;
        assert!(k <= n, "cannot draw {k} distinct values from {n}");
        let start = out.len();
        for j in n - k..n {
            let t = self.below(j + 1);
            let pick = if out[start..].contains(&((lo + t) as i64)) {
                j
            } else {
                t
            };
            out.push((lo + pick) as i64);
        }
        self.shuffle(&mut out[start..]);
    }
}

/// The seed of rank `rank`'s generator in [`rank_inputs`].
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    mix64(
        seed ^ mix64(
            (rank as u64)
                .wrapping_add(1)
                .wrapping_mul(0xD1B5_4A32_D192_ED03),
        ),
    )
}

/// How tokens pick their experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Routing {
    /// `K` distinct experts, uniformly at random.
    Uniform,
    /// One hot expert (expert 0) is in a `hot_share` fraction of the tokens
    /// (in expectation); every other pick is uniform over experts `1..E`.
    /// When `E == K` every token has every expert.
    Skewed {
        /// Probability in `[0, 1]` that a token routes to expert 0.
        hot_share: f64,
    },
    /// Uniform, then each slot is masked to `-1` with probability
    /// `masked_share`.
    Masked {
        /// Probability in `[0, 1]` that a slot is masked.
        masked_share: f64,
    },
}

impl Routing {
    /// The routing of a random test case: uniform, skewed or masked by
    /// `seed % 3`, the share drawn from `rng`.
    pub fn for_case(seed: u64, rng: &mut Rng) -> Routing {
        match seed % 3 {
            0 => Routing::Uniform,
            1 => Routing::Skewed {
                hot_share: rng.f64_unit(),
            },
            _ => Routing::Masked {
                masked_share: rng.f64_unit(),
            },
        }
    }
}

/// Tokens per rank of a random test case: each rank 0 (one in four), 1 (one
/// in four) or below 40.
pub fn case_tokens_per_rank(rng: &mut Rng, ranks: usize) -> Vec<usize> {
    (0..ranks)
        .map(|_| match rng.below(4) {
            0 => 0,
            1 => 1,
            _ => rng.below(40),
        })
        .collect()
}

/// `[num_tokens * K]` top-k expert ids: distinct experts per token, `-1` for
/// masked slots (only with [`Routing::Masked`]). Expert order inside a token's
/// row is random.
///
/// # Panics
/// If `shape.topk > shape.num_experts` (rejected by [`Shape::validate`]).
pub fn topk_idx(rng: &mut Rng, num_tokens: usize, shape: &Shape, routing: Routing) -> Vec<i64> {
    let (e, k) = (shape.num_experts, shape.topk);
    assert!(k <= e, "topk {k} > num_experts {e}");
    let mut out = Vec::with_capacity(num_tokens * k);
    for _ in 0..num_tokens {
        let start = out.len();
        match routing {
            Routing::Uniform => rng.distinct(0, e, k, &mut out),
            Routing::Skewed { hot_share } => {
                if e == k {
                    rng.distinct(0, e, k, &mut out);
                } else if rng.f64_unit() < hot_share {
                    out.push(0);
                    rng.distinct(1, e, k - 1, &mut out);
                    rng.shuffle(&mut out[start..]);
                } else {
                    rng.distinct(1, e, k, &mut out);
                }
            }
            Routing::Masked { masked_share } => {
                rng.distinct(0, e, k, &mut out);
                for slot in &mut out[start..] {
                    if rng.f64_unit() < masked_share {
                        *slot = -1;
                    }
                }
            }
        }
    }
    out
}

/// `[num_tokens * k]` routing weights: every weight positive, each row's
/// weights sum to 1 (up to f32 rounding).
pub fn topk_weights(rng: &mut Rng, num_tokens: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(num_tokens * k);
    for _ in 0..num_tokens {
        let start = out.len();
        out.extend((0..k).map(|_| 0.1 + rng.f32_unit()));
        let sum: f32 = out[start..].iter().sum();
        for w in &mut out[start..] {
            *w /= sum;
        }
    }
    out
}

/// `[num_tokens * hidden]` token values, uniform in `[-1, 1)` rounded to bf16;
/// no row is all zeros.
pub fn tokens(rng: &mut Rng, num_tokens: usize, hidden: usize) -> Vec<bf16> {
    // The largest bf16 below 1.0, for values that round up to 1.0.
    let below_one = bf16::from_f32(1.0 - 1.0 / 256.0);
    let mut out = Vec::with_capacity(num_tokens * hidden);
    for _ in 0..num_tokens {
        let start = out.len();
        out.extend((0..hidden).map(|_| {
            let x = bf16::from_f32(2.0 * rng.f32_unit() - 1.0);
            if x >= bf16::ONE {
                below_one
            } else {
                x
            }
        }));
        if hidden > 0 && out[start..].iter().all(|x| x.to_f32() == 0.0) {
            out[start] = bf16::from_f32(0.5);
        }
    }
    out
}

/// One [`RankInput`] per rank, rank `r` having `tokens_per_rank[r]` tokens.
///
/// Rank `r` draws from `Rng::new(rank_seed(seed, r))`: first `topk_idx`, then
/// `topk_weights`, then `tokens`, so any process can rebuild any rank's
/// inputs (or just its routing, by calling [`topk_idx`] alone on that
/// generator).
///
/// # Panics
/// If `tokens_per_rank.len() != shape.num_ranks` or `topk > num_experts`.
pub fn rank_inputs(
    seed: u64,
    shape: &Shape,
    tokens_per_rank: &[usize],
    routing: Routing,
) -> Vec<RankInput> {
    assert_eq!(
        tokens_per_rank.len(),
        shape.num_ranks,
        "one token count per rank"
    );
    tokens_per_rank
        .iter()
        .enumerate()
        .map(|(r, &t)| {
            let mut rng = Rng::new(rank_seed(seed, r));
            let topk_idx = topk_idx(&mut rng, t, shape, routing);
            let topk_weights = topk_weights(&mut rng, t, shape.topk);
            let tokens = tokens(&mut rng, t, shape.hidden);
            RankInput {
                tokens,
                topk_idx,
                topk_weights,
            }
        })
        .collect()
}

/// Reads a routing file: integers separated by whitespace and/or commas, `k`
/// per line (one line per token, `[T * k]` row-major). Blank lines and text
/// after `#` are ignored. Values are not range-checked here; run
/// [`crate::reference::validate_topk`] on the result.
///
/// Errors: [`Error::Io`] if the file cannot be read; an error naming `routing`
/// (with `path:line`) for a non-integer or a line without exactly `k` values;
/// naming `topk` if `k == 0`.
pub fn read_topk_file(path: impl AsRef<Path>, k: usize) -> Result<Vec<i64>> {
    let path = path.as_ref();
    if k == 0 {
        return Err(Error::arg("topk", "at least 1", k));
    }
    let text = std::fs::read_to_string(path)?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("");
        let start = out.len();
        for word in line
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|w| !w.is_empty())
        {
            let v: i64 = word.parse().map_err(|_| {
                Error::arg(
                    "routing",
                    "integer expert ids",
                    format!("{word:?} at {}:{}", path.display(), n + 1),
                )
            })?;
            out.push(v);
        }
        let found = out.len() - start;
        if found != 0 && found != k {
            return Err(Error::arg(
                "routing",
                format!("{k} expert ids per line"),
                format!("{found} at {}:{}", path.display(), n + 1),
            ));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::validate_topk;

    fn shape(r: usize, e: usize, k: usize) -> Shape {
        Shape {
            num_ranks: r,
            num_experts: e,
            hidden: 16,
            topk: k,
        }
    }

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(Rng::new(1).next_u64(), Rng::new(2).next_u64());
        // SplitMix64 reference value for seed 0.
        assert_eq!(Rng::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
        let mut rng = Rng::new(7);
        let mut hist = [0usize; 6];
        for _ in 0..60_000 {
            hist[rng.below(6)] += 1;
            let f = rng.f32_unit();
            assert!((0.0..1.0).contains(&f));
            let d = rng.f64_unit();
            assert!((0.0..1.0).contains(&d));
        }
        assert!(
            hist.iter().all(|&n| (9_000..11_000).contains(&n)),
            "{hist:?}"
        );
        assert_eq!(rng.below(1), 0);
        let mut v: Vec<usize> = (0..20).collect();
        rng.shuffle(&mut v);
        let mut sorted = v.clone();
        sorted.sort();
        assert_eq!(sorted, (0..20).collect::<Vec<_>>());
    }

    #[test]
    fn topk_idx_is_valid_for_every_routing() {
        let routings = [
            Routing::Uniform,
            Routing::Skewed { hot_share: 0.5 },
            Routing::Masked { masked_share: 0.3 },
        ];
        for (i, &(r, e, k)) in [
            (1, 1, 1),
            (2, 4, 4),
            (4, 16, 8),
            (8, 16, 16),
            (8, 256, 8),
            (3, 18, 2),
        ]
        .iter()
        .enumerate()
        {
            let s = shape(r, e, k);
            for routing in routings {
                let mut rng = Rng::new(i as u64);
                let idx = topk_idx(&mut rng, 300, &s, routing);
                assert_eq!(idx.len(), 300 * k);
                validate_topk(&s, &idx).unwrap();
                if !matches!(routing, Routing::Masked { .. }) {
                    assert!(idx.iter().all(|&x| x >= 0));
                }
            }
        }
    }

    #[test]
    fn routing_shares_are_respected() {
        let s = shape(4, 32, 4);
        let t = 20_000;
        let mut rng = Rng::new(3);
        let idx = topk_idx(&mut rng, t, &s, Routing::Skewed { hot_share: 0.6 });
        let hot = idx.chunks(4).filter(|row| row.contains(&0)).count() as f64 / t as f64;
        assert!((hot - 0.6).abs() < 0.02, "hot share {hot}");
        // Expert 0 appears in random slots, not always slot 0.
        assert!(idx.chunks(4).any(|row| row[3] == 0));
        let idx = topk_idx(&mut rng, t, &s, Routing::Masked { masked_share: 0.25 });
        let masked = idx.iter().filter(|&&x| x == -1).count() as f64 / idx.len() as f64;
        assert!((masked - 0.25).abs() < 0.02, "masked share {masked}");
        let idx = topk_idx(&mut rng, t, &s, Routing::Uniform);
        let mut per_expert = vec![0usize; 32];
        for &e in &idx {
            per_expert[e as usize] += 1;
        }
        let mean = (t * 4 / 32) as f64;
        assert!(
            per_expert
                .iter()
                .all(|&n| (n as f64 - mean).abs() < 0.1 * mean),
            "{per_expert:?}"
        );
        // E == K: every token gets every expert, whatever the routing.
        let s = shape(2, 4, 4);
        let idx = topk_idx(&mut rng, 50, &s, Routing::Skewed { hot_share: 0.0 });
        validate_topk(&s, &idx).unwrap();
        assert!(idx.iter().all(|&x| x >= 0));
    }

    #[test]
    fn weights_and_tokens_have_the_promised_ranges() {
        let mut rng = Rng::new(11);
        for k in [1, 2, 8, 16] {
            let w = topk_weights(&mut rng, 100, k);
            assert_eq!(w.len(), 100 * k);
            for row in w.chunks(k) {
                assert!(row.iter().all(|&x| x > 0.0));
                let sum: f32 = row.iter().sum();
                assert!((sum - 1.0).abs() < 1e-5, "{sum}");
            }
        }
        let x = tokens(&mut rng, 500, 64);
        assert_eq!(x.len(), 500 * 64);
        assert!(x.iter().all(|v| (-1.0..1.0).contains(&v.to_f32())));
        assert!(x
            .chunks(64)
            .all(|row| row.iter().any(|v| v.to_f32() != 0.0)));
        assert!(x.iter().any(|v| v.to_f32() < -0.9) && x.iter().any(|v| v.to_f32() > 0.9));
        assert!(tokens(&mut rng, 0, 64).is_empty());
    }

    #[test]
    fn rank_inputs_are_reproducible_per_rank() {
        let s = shape(4, 16, 4);
        let routing = Routing::Masked { masked_share: 0.1 };
        let a = rank_inputs(5, &s, &[10, 0, 3, 7], routing);
        let b = rank_inputs(5, &s, &[2, 9, 3, 1], routing);
        assert_eq!(a.len(), 4);
        // Rank 2's inputs depend only on (seed, rank, its own token count).
        assert_eq!(a[2].topk_idx, b[2].topk_idx);
        assert_eq!(a[2].topk_weights, b[2].topk_weights);
        assert_eq!(a[2].tokens, b[2].tokens);
        assert_ne!(a[0].topk_idx[..8], a[3].topk_idx[..8]);
        let c = rank_inputs(6, &s, &[10, 0, 3, 7], routing);
        assert_ne!(a[0].tokens, c[0].tokens);
        for (inp, t) in a.iter().zip([10, 0, 3, 7]) {
            assert_eq!(inp.num_tokens(&s), t);
            assert_eq!(inp.topk_weights.len(), t * 4);
            assert_eq!(inp.tokens.len(), t * 16);
            validate_topk(&s, &inp.topk_idx).unwrap();
        }
        // The routing alone can be rebuilt from the rank's generator.
        let mut rng = Rng::new(rank_seed(5, 3));
        assert_eq!(topk_idx(&mut rng, 7, &s, routing), a[3].topk_idx);
    }

    #[test]
    fn topk_file_round_trip_and_errors() {
        let dir = std::env::temp_dir().join(format!("moe-ep-workload-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.txt");
        std::fs::write(&good, "# routing\n0, 3\n\n1 -1  # masked\n2,\t3\n").unwrap();
        assert_eq!(read_topk_file(&good, 2).unwrap(), vec![0, 3, 1, -1, 2, 3]);

        let short = dir.join("short.txt");
        std::fs::write(&short, "0 1\n2\n").unwrap();
        let msg = read_topk_file(&short, 2).unwrap_err().to_string();
        assert!(
            msg.contains("`routing`") && msg.contains("short.txt:2"),
            "{msg}"
        );

        let word = dir.join("word.txt");
        std::fs::write(&word, "0 x\n").unwrap();
        let msg = read_topk_file(&word, 2).unwrap_err().to_string();
        assert!(msg.contains("`routing`") && msg.contains("\"x\""), "{msg}");

        let msg = read_topk_file(&good, 0).unwrap_err().to_string();
        assert!(msg.contains("`topk`"), "{msg}");
        let err = read_topk_file(dir.join("missing.txt"), 2).unwrap_err();
        assert!(matches!(err, Error::Io(_)), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
