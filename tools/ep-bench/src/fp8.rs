//! The fp8 rows of `dispatch-fp8` on the host: each rank's random e4m3
//! codes and scales ([`payload`]), what a rank must receive
//! ([`expected`], from `moe_ep::reference::dispatch_rows`), the comparison
//! of what it got ([`compare`], bit for bit, the first difference named),
//! and the packing that lets NCCL EP's fp8 rows go through the bf16 rows'
//! cross-check ([`packed`]).
//!
//! Dispatch moves the codes and scales as given, so any bytes do: codes
//! are random bytes (NaN codes included), e8m0 scales random bytes, f32
//! scales random values in [0, 8). Both libraries are given the same ones.

use moe_ep::bf16;
use moe_ep::reference::{self as refr, DispatchOutput, RankInput, Shape};
use moe_ep::testkit::workload::{self, Rng};
use moe_ep::RecvLayout;

use crate::cli::ScaleKind;

/// One rank's block scales, of one kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    /// `[T, H / 128]` f32.
    F32(Vec<f32>),
    /// `[T, H / 32]` e8m0 bytes.
    E8m0(Vec<u8>),
}

impl Scales {
    /// The kind.
    pub fn kind(&self) -> ScaleKind {
        match self {
            Scales::F32(_) => ScaleKind::F32,
            Scales::E8m0(_) => ScaleKind::E8m0,
        }
    }

    /// The scales as they lie in memory (f32 in the machine's byte order).
    pub fn bytes(&self) -> Vec<u8> {
        match self {
            Scales::F32(v) => v.iter().flat_map(|x| x.to_ne_bytes()).collect(),
            Scales::E8m0(v) => v.clone(),
        }
    }
}

/// One rank's fp8 rows: `[T, H]` e4m3 codes and their scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Payload {
    pub codes: Vec<u8>,
    pub scales: Scales,
}

/// Rank `rank`'s codes and scales of `kind` for `tokens` rows of `hidden`
/// values, from the run's `seed` (every rank can rebuild every other
/// rank's).
pub fn payload(seed: u64, rank: usize, tokens: usize, hidden: usize, kind: ScaleKind) -> Payload {
    let mut rng = Rng::new(workload::rank_seed(seed, rank) ^ 0x0F8C_0DE5);
    let mut codes = vec![0u8; tokens * hidden];
    for eight in codes.chunks_mut(8) {
        eight.copy_from_slice(&rng.next_u64().to_le_bytes()[..eight.len()]);
    }
    let n = tokens * kind.per_row(hidden);
    let scales = match kind {
        ScaleKind::F32 => Scales::F32((0..n).map(|_| rng.f32_unit() * 8.0).collect()),
        ScaleKind::E8m0 => Scales::E8m0((0..n).map(|_| rng.next_u64() as u8).collect()),
    };
    Payload { codes, scales }
}

/// What one rank receives in an fp8 dispatch, or what it must.
#[derive(Clone, Debug, PartialEq)]
pub struct Rows {
    /// Rows (expert-major: padding included).
    pub rows: usize,
    /// `[rows, H]` codes.
    pub codes: Vec<u8>,
    /// `[rows, H / 128]` f32 or `[rows, H / 32]` e8m0.
    pub scales: Scales,
    /// Rank-major `[rows, K]`, expert-major `[rows]`.
    pub weights: Vec<f32>,
    /// Local expert ids, as the weights; -1 off this rank or padding.
    pub idx: Vec<i32>,
    /// `[rows]` (source rank, token); (-1, -1) on padding.
    pub src: Vec<(i32, i32)>,
}

/// What rank `dst` must receive of every rank's `payloads` (the routing,
/// weights and sources of `inputs`, whose tokens are not read), and the
/// reference's dispatch output of its (bf16) tokens beside it.
pub fn expected(
    shape: &Shape,
    inputs: &[RankInput],
    payloads: &[Payload],
    dst: usize,
    layout: RecvLayout,
) -> Result<(Rows, DispatchOutput), String> {
    let h = shape.hidden;
    let want = refr::dispatch(shape, inputs, dst, layout).map_err(|e| e.to_string())?;
    let codes: Vec<Vec<u8>> = payloads.iter().map(|p| p.codes.clone()).collect();
    let codes = refr::dispatch_rows(shape, inputs, &codes, h, dst, layout).map_err(s)?;
    let kind = payloads.first().map_or(ScaleKind::F32, |p| p.scales.kind());
    let width = kind.per_row(h);
    let scales = match kind {
        ScaleKind::F32 => {
            let v: Vec<Vec<f32>> = payloads
                .iter()
                .map(|p| match &p.scales {
                    Scales::F32(v) => Ok(v.clone()),
                    Scales::E8m0(_) => Err("payloads of both scale kinds".to_string()),
                })
                .collect::<Result<_, _>>()?;
            Scales::F32(refr::dispatch_rows(shape, inputs, &v, width, dst, layout).map_err(s)?)
        }
        ScaleKind::E8m0 => {
            let v: Vec<Vec<u8>> = payloads
                .iter()
                .map(|p| match &p.scales {
                    Scales::E8m0(v) => Ok(v.clone()),
                    Scales::F32(_) => Err("payloads of both scale kinds".to_string()),
                })
                .collect::<Result<_, _>>()?;
            Scales::E8m0(refr::dispatch_rows(shape, inputs, &v, width, dst, layout).map_err(s)?)
        }
    };
    let rows = Rows {
        rows: want.num_rows,
        codes,
        scales,
        weights: want.topk_weights.clone(),
        idx: want.topk_local_idx.clone(),
        src: want.src.clone(),
    };
    Ok((rows, want))
}

fn s<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// `got` against `want` bit for bit: the row count, then codes, scales,
/// weights, local expert ids and sources; the first difference is named
/// (`row 3, code 17: got 0x5a, want 0x3c`).
pub fn compare(want: &Rows, got: &Rows, hidden: usize) -> Result<(), String> {
    if got.rows != want.rows {
        return Err(format!(
            "{} rows received, the reference {}",
            got.rows, want.rows
        ));
    }
    let rows = want.rows.max(1);
    /// First index where `a` and `b` differ (lengths included).
    fn first<T: PartialEq>(a: &[T], b: &[T]) -> Option<usize> {
        (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))
    }
    let named = |what: &str, i: usize, width: usize, g: String, w: String| {
        let width = width.max(1);
        format!("row {}, {what} {}: got {g}, want {w}", i / width, i % width)
    };
    let show = |v: Option<String>| v.unwrap_or_else(|| "nothing".into());
    if let Some(i) = first(&got.codes, &want.codes) {
        return Err(named(
            "code",
            i,
            hidden,
            show(got.codes.get(i).map(|b| format!("{b:#04x}"))),
            show(want.codes.get(i).map(|b| format!("{b:#04x}"))),
        ));
    }
    let (gs, ws) = (got.scales.bytes(), want.scales.bytes());
    if got.scales.kind() != want.scales.kind() {
        return Err(format!(
            "scales: got {}, want {}",
            got.scales.kind().describe(),
            want.scales.kind().describe()
        ));
    }
    if let Some(i) = first(&gs, &ws) {
        let kind = want.scales.kind();
        let (unit, per) = (kind.scale_bytes(), kind.per_row(hidden));
        let at = |v: &Scales, j: usize| match v {
            Scales::F32(v) => v.get(j).map(|x| format!("{x} ({:#010x})", x.to_bits())),
            Scales::E8m0(v) => v.get(j).map(|b| format!("{b:#04x}")),
        };
        let j = i / unit;
        return Err(named(
            "scale",
            j,
            per,
            show(at(&got.scales, j)),
            show(at(&want.scales, j)),
        ));
    }
    let per = want.weights.len() / rows;
    let wbits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if let Some(i) = first(&wbits(&got.weights), &wbits(&want.weights)) {
        return Err(named(
            "weight",
            i,
            per,
            show(got.weights.get(i).map(|x| x.to_string())),
            show(want.weights.get(i).map(|x| x.to_string())),
        ));
    }
    if let Some(i) = first(&got.idx, &want.idx) {
        return Err(named(
            "local expert id",
            i,
            per,
            show(got.idx.get(i).map(|x| x.to_string())),
            show(want.idx.get(i).map(|x| x.to_string())),
        ));
    }
    if let Some(i) = first(&got.src, &want.src) {
        return Err(format!(
            "row {i}: source {}, want {}",
            show(got.src.get(i).map(|p| format!("{p:?}"))),
            show(want.src.get(i).map(|p| format!("{p:?}")))
        ));
    }
    Ok(())
}

/// Words (two bytes each) of one packed row: `hidden` codes and
/// `hidden / 32` bytes of scales (`hidden` a multiple of 128: even).
pub fn packed_width(hidden: usize) -> usize {
    (hidden + hidden / 32) / 2
}

/// `rows` rows of `hidden` codes each followed by its `hidden / 32` bytes
/// of scales (`scales`, in memory order), two bytes to a word, as bf16 bit
/// patterns: the bytes of a row of codes and its scales as one row of
/// [`packed_width`] bf16 values, so that the bf16 rows' cross-check
/// ([`crate::nccl_ep::compare_dispatch`], bit for bit and order-free)
/// compares fp8 rows with their scales, each scale row kept beside its row.
pub fn packed(codes: &[u8], scales: &[u8], rows: usize, hidden: usize) -> Vec<bf16> {
    let sw = hidden / 32;
    let mut out = Vec::with_capacity(rows * packed_width(hidden));
    for r in 0..rows {
        let code = codes.get(r * hidden..(r + 1) * hidden).unwrap_or(&[]);
        let scale = scales.get(r * sw..(r + 1) * sw).unwrap_or(&[]);
        let row: Vec<u8> = code.iter().chain(scale).copied().collect();
        out.extend(
            row.chunks(2)
                .map(|p| bf16::from_bits(u16::from_le_bytes([p[0], *p.get(1).unwrap_or(&0)]))),
        );
    }
    out
}

/// The reference's dispatch output `want` with its token rows replaced by
/// the packed fp8 rows of `rows` ([`packed`]): what NCCL EP's fp8 dispatch
/// must deliver, for [`crate::nccl_ep::compare_dispatch`] with
/// [`packed_width`] as the hidden size.
pub fn packed_output(want: &DispatchOutput, rows: &Rows, hidden: usize) -> DispatchOutput {
    DispatchOutput {
        tokens: packed(&rows.codes, &rows.scales.bytes(), rows.rows, hidden),
        ..want.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_ep::testkit::workload::Routing;

    const H: usize = 256;

    fn world(kind: ScaleKind) -> (Shape, Vec<RankInput>, Vec<Payload>) {
        let shape = Shape {
            num_ranks: 2,
            num_experts: 16,
            hidden: H,
            topk: 4,
        };
        let inputs = workload::rank_inputs(3, &shape, &[20, 17], Routing::Uniform);
        let payloads = (0..2)
            .map(|r| payload(9, r, inputs[r].topk_idx.len() / 4, H, kind))
            .collect();
        (shape, inputs, payloads)
    }

    #[test]
    fn payloads_are_per_rank_and_of_their_kind() {
        let a = payload(1, 0, 5, H, ScaleKind::F32);
        assert_eq!((a.codes.len(), a.scales.bytes().len()), (5 * H, 5 * H / 32));
        assert_eq!(a, payload(1, 0, 5, H, ScaleKind::F32));
        assert_ne!(a.codes, payload(1, 1, 5, H, ScaleKind::F32).codes);
        let e = payload(1, 0, 5, H, ScaleKind::E8m0);
        assert_eq!(e.scales.kind(), ScaleKind::E8m0);
        assert_eq!(e.scales.bytes().len(), 5 * H / 32);
        let Scales::F32(v) = &a.scales else {
            panic!("f32 scales")
        };
        assert!(v.iter().all(|x| x.is_finite() && (0.0..8.0).contains(x)));
    }

    /// The rows the reference sends, as a GPU that moved them right would
    /// report them, pass; each kind of difference is named.
    #[test]
    fn compare_names_the_first_difference() {
        for layout in [
            RecvLayout::RankMajor,
            RecvLayout::ExpertMajor { alignment: 4 },
        ] {
            for kind in [ScaleKind::F32, ScaleKind::E8m0] {
                let (shape, inputs, payloads) = world(kind);
                let (want, bf) = expected(&shape, &inputs, &payloads, 1, layout).unwrap();
                assert_eq!(want.rows, bf.num_rows);
                assert_eq!(want.codes.len(), want.rows * H);
                assert_eq!(want.scales.bytes().len(), want.rows * H / 32);
                assert_eq!(compare(&want, &want.clone(), H), Ok(()));
                // A row received from rank 0, token 0 carries that token's codes.
                let i = want.src.iter().position(|&p| p == (0, 0)).unwrap();
                assert_eq!(want.codes[i * H..(i + 1) * H], payloads[0].codes[..H]);

                let mut got = want.clone();
                got.codes[3 * H + 17] ^= 1;
                let e = compare(&want, &got, H).unwrap_err();
                assert!(e.starts_with("row 3, code 17:"), "{e}");

                let mut got = want.clone();
                match &mut got.scales {
                    Scales::F32(v) => v[2 * (H / 128) + 1] = -1.0,
                    Scales::E8m0(v) => v[2 * (H / 32) + 1] ^= 0x80,
                }
                let e = compare(&want, &got, H).unwrap_err();
                assert!(e.starts_with("row 2, scale 1:"), "{e}");

                let mut got = want.clone();
                got.weights[1] = f32::from_bits(got.weights[1].to_bits() ^ 1);
                assert!(compare(&want, &got, H).unwrap_err().contains("weight"));
                let mut got = want.clone();
                got.idx[0] = 99;
                assert!(compare(&want, &got, H)
                    .unwrap_err()
                    .contains("local expert id"));
                let mut got = want.clone();
                got.src[1] = (7, 7);
                assert!(compare(&want, &got, H).unwrap_err().contains("source"));
                let mut got = want.clone();
                got.rows -= 1;
                assert!(compare(&want, &got, H).unwrap_err().contains("rows"));
                let mut got = want.clone();
                got.scales = match kind {
                    ScaleKind::F32 => Scales::E8m0(vec![0; want.rows * H / 32]),
                    ScaleKind::E8m0 => Scales::F32(vec![0.0; want.rows * H / 128]),
                };
                assert!(compare(&want, &got, H).unwrap_err().contains("scales"));
            }
        }
    }

    /// Expert-major padding rows: zero codes, zero scales.
    #[test]
    fn padding_is_zero() {
        let layout = RecvLayout::ExpertMajor { alignment: 8 };
        let (shape, inputs, payloads) = world(ScaleKind::E8m0);
        let (want, _) = expected(&shape, &inputs, &payloads, 0, layout).unwrap();
        let pad = want.src.iter().position(|&p| p.0 < 0).unwrap();
        assert!(want.codes[pad * H..(pad + 1) * H].iter().all(|&b| b == 0));
        let sc = want.scales.bytes();
        assert!(sc[pad * H / 32..(pad + 1) * H / 32].iter().all(|&b| b == 0));
    }

    /// Packed rows keep each row's codes then its scale bytes, and go
    /// through NCCL EP's cross-check: the same rows pass in another order,
    /// a changed scale byte fails.
    #[test]
    fn packed_rows_go_through_the_cross_check() {
        assert_eq!(packed_width(7168), 3696);
        // One row of 64 codes 0..64 and its 2 scale bytes: 33 words.
        let codes: Vec<u8> = (0..64).collect();
        let p: Vec<u16> = packed(&codes, &[9, 8], 1, 64)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!((p.len(), p[0], p[31], p[32]), (33, 0x0100, 0x3f3e, 0x0809));
        let layout = RecvLayout::RankMajor;
        let (shape, inputs, payloads) = world(ScaleKind::F32);
        let (want, bf) = expected(&shape, &inputs, &payloads, 1, layout).unwrap();
        let out = packed_output(&bf, &want, H);
        assert_eq!(out.tokens.len(), want.rows * packed_width(H));
        let w = packed_width(H);
        let got = crate::nccl_ep::Received {
            total: want.rows,
            rows: out.tokens.clone(),
            weights: want.weights.clone(),
            idx: Some(want.idx.iter().map(|&v| i64::from(v)).collect()),
            counts: bf
                .tokens_per_local_expert
                .iter()
                .map(|&n| n as i64)
                .collect(),
            offsets: None,
        };
        let k = shape.topk;
        assert!(crate::nccl_ep::compare_dispatch(&out, &got, layout, w, k).is_ok());
        // Rows 0 and 2 swapped with their slots: still the same rows.
        let mut swapped = got.clone();
        for c in 0..w {
            swapped.rows.swap(c, 2 * w + c);
        }
        for c in 0..k {
            swapped.weights.swap(c, 2 * k + c);
            swapped.idx.as_mut().unwrap().swap(c, 2 * k + c);
        }
        assert!(crate::nccl_ep::compare_dispatch(&out, &swapped, layout, w, k).is_ok());
        // The last scale byte of row 1 changed: no reference row has it.
        let mut bad = got;
        let at = 2 * w - 1;
        bad.rows[at] = bf16::from_bits(bad.rows[at].to_bits() ^ 0x0100);
        let e = crate::nccl_ep::compare_dispatch(&out, &bad, layout, w, k).unwrap_err();
        assert!(e.contains("row 1"), "{e}");
    }
}
