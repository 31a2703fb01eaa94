//! `--plot`: an SVG line chart (plotters) of NVLink GB/s against tokens per
//! rank, one line per op, baselines dashed.

use plotters::prelude::*;

use crate::report::{field_label, varying_fields, CaseResult, Ranks};

/// Chart size in SVG pixels.
const SIZE: (u32, u32) = (960, 540);

/// One line of the chart.
struct Series {
    /// The op, with the other varying case fields.
    label: String,
    /// A baseline (drawn dashed), not one of our ops.
    baseline: bool,
    /// (tokens per rank, GB/s), sorted by tokens.
    points: Vec<(f64, f64)>,
}

/// The lines of the chart: one per op (when other case fields vary too, one
/// per op and values of those fields), in order of first appearance; ops
/// that move no bytes (layout) are left out. NVLink GB/s, or on virtual
/// ranks (which cross no NVLink) logical GB/s.
fn series(results: &[CaseResult]) -> Vec<Series> {
    let others: Vec<usize> = varying_fields(results)
        .into_iter()
        .filter(|&i| i != 0)
        .collect();
    let mut out: Vec<Series> = Vec::new();
    let nvlink = draws_nvlink(results);
    for res in results {
        let suffix: Vec<String> = others.iter().map(|&i| field_label(&res.case, i)).collect();
        for op in &res.ops {
            let y = match nvlink {
                true => op.nvlink_gbps(),
                false => op.logical_gbps(),
            };
            if op.slowest_rank().is_none() || !y.is_finite() {
                continue;
            }
            let label = if suffix.is_empty() {
                op.op.clone()
            } else {
                format!("{} ({})", op.op, suffix.join(", "))
            };
            let point = (res.case.tokens as f64, y);
            match out.iter_mut().find(|s| s.label == label) {
                Some(s) => s.points.push(point),
                None => out.push(Series {
                    label,
                    baseline: !op.is_ours(),
                    points: vec![point],
                }),
            }
        }
    }
    out.retain(|s| s.points.iter().any(|&(_, y)| y > 0.0));
    for s in &mut out {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Whether the chart is of NVLink GB/s: not for virtual ranks' results.
fn draws_nvlink(results: &[CaseResult]) -> bool {
    results.first().is_none_or(|r| r.ranks == Ranks::Nccl)
}

/// The chart as a complete SVG document. x is log2-scaled when the token
/// values span more than 8x (and none is 0), linear otherwise. Errors when
/// the sweep has fewer than 2 token values or nothing to draw.
pub fn svg(results: &[CaseResult], title: &str) -> Result<String, String> {
    let mut tokens: Vec<f64> = results.iter().map(|r| r.case.tokens as f64).collect();
    tokens.sort_by(f64::total_cmp);
    tokens.dedup();
    if tokens.len() < 2 {
        return Err(format!(
            "the sweep has {} token value(s); a line needs at least 2 (e.g. --tokens 1024,2048,4096)",
            tokens.len()
        ));
    }
    let lines = series(results);
    if lines.is_empty() {
        return Err("nothing to draw (no op moved NVLink bytes)".to_string());
    }
    let (lo, hi) = (tokens[0], tokens[tokens.len() - 1]);
    let log = lo > 0.0 && hi / lo > 8.0;
    // Log scale: plot log2(tokens) and label the ticks with powers of two.
    let x = move |t: f64| if log { t.log2() } else { t };
    let x_range = if log {
        lo.log2().floor()..hi.log2().ceil()
    } else {
        lo..hi
    };
    let y_max = lines
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        * 1.1;
    let mut out = String::new();
    let drawn = (|| -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x_range, 0.0..y_max)?;
        let x_label = |v: &f64| {
            if log {
                format!("{}", 2f64.powf(*v).round())
            } else {
                format!("{v}")
            }
        };
        chart
            .configure_mesh()
            .x_desc(if log {
                "tokens per rank (log2 scale)"
            } else {
                "tokens per rank"
            })
            .y_desc(match draws_nvlink(results) {
                true => "NVLink GB/s (slowest rank)",
                false => "logical GB/s (slowest rank; virtual ranks, no NVLink)",
            })
            .x_label_formatter(&x_label)
            .draw()?;
        for (i, s) in lines.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let style = color.stroke_width(2);
            let pts: Vec<(f64, f64)> = s.points.iter().map(|&(t, y)| (x(t), y)).collect();
            let drawn = if s.baseline {
                chart.draw_series(DashedLineSeries::new(pts.clone(), 6, 4, style))?
            } else {
                chart.draw_series(LineSeries::new(pts.clone(), style))?
            };
            drawn
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 24, y)], style));
            let marker = if s.baseline { style } else { color.filled() };
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, marker)))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    })();
    drawn.map_err(|e| e.to_string())?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample;

    #[test]
    fn one_series_per_op_linear() {
        let results: Vec<_> = [1024, 2048, 4096]
            .iter()
            .map(|&t| sample(t, 7168, None))
            .collect();
        let lines = series(&results);
        // dispatch, combine, nccl-alltoall, peer-store-ceiling (layout has no bytes).
        let labels: Vec<&str> = lines.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            ["dispatch", "combine", "nccl-alltoall", "peer-store-ceiling"]
        );
        assert_eq!(lines.iter().filter(|s| s.baseline).count(), 2);
        assert!(lines.iter().all(|s| s.points.len() == 3));
        let s = svg(&results, "dispatch <H200> & co").unwrap();
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
        assert!(s.contains("dispatch &lt;H200&gt; &amp; co"));
        assert!(s.contains("peer-store-ceiling") && s.contains("NVLink GB/s"));
        assert!(!s.contains("log2 scale"));
    }

    #[test]
    fn log_scale_and_extra_series() {
        let mut results = Vec::new();
        for hidden in [4096, 7168] {
            for t in [128, 1024, 8192] {
                results.push(sample(t, hidden, None));
            }
        }
        let lines = series(&results);
        assert_eq!(lines.len(), 8);
        assert!(lines.iter().any(|s| s.label == "dispatch (hidden=4096)"));
        let s = svg(&results, "sweep").unwrap();
        assert!(s.contains("log2 scale"));
        assert!(s.contains("dispatch (hidden=7168)"));
        assert!(s.contains("\n128\n") && s.contains("\n8192\n"), "{s}");
    }

    /// Virtual ranks cross no NVLink: their chart is of logical GB/s.
    #[test]
    fn virtual_ranks_draw_logical_bandwidth() {
        let results: Vec<_> = [1024, 2048]
            .iter()
            .map(|&t| {
                let mut r = sample(t, 7168, None);
                r.ranks = Ranks::Virtual;
                r
            })
            .collect();
        let lines = series(&results);
        // dispatch rank 1: 2e6 * 1.5 logical B over 100 µs (1024 tokens) = 30 GB/s.
        let d = lines.iter().find(|s| s.label == "dispatch").unwrap();
        assert!((d.points[0].1 - 30.0).abs() < 1e-9, "{:?}", d.points);
        let s = svg(&results, "virtual").unwrap();
        assert!(
            s.contains("logical GB/s") && !s.contains("NVLink GB/s"),
            "{s}"
        );
    }

    #[test]
    fn errors() {
        let one = vec![sample(1024, 7168, None), sample(1024, 4096, None)];
        assert!(svg(&one, "x").unwrap_err().contains("at least 2"));
        assert!(svg(&[], "x").is_err());
        let mut nobytes: Vec<_> = [1, 2].iter().map(|&t| sample(t, 8, None)).collect();
        for r in &mut nobytes {
            r.ops.truncate(1); // only layout
        }
        assert!(svg(&nobytes, "x").unwrap_err().contains("nothing"));
    }
}
