//! A plain, dependency-free SVG line chart of NVLink GB/s against tokens per
//! rank: one polyline with markers per series, baselines dashed, ticks with
//! labels, a legend and a title.

use std::fmt::Write as _;

use crate::report::{varying_fields, CaseField, CaseResult};

/// Plot-area size and margins in SVG user units (px); the right margin
/// (legend) and the height grow with the legend.
const PLOT_W: f64 = 640.0;
const MIN_HEIGHT: f64 = 540.0;
const LEFT: f64 = 72.0;
const MIN_RIGHT: f64 = 250.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 64.0;
/// Vertical distance between legend entries (px).
const LEGEND_STEP: f64 = 20.0;

const COLORS: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#7f7f7f",
];

/// One line of the chart.
struct Series {
    label: String,
    baseline: bool,
    /// (tokens per rank, GB/s), sorted by tokens.
    points: Vec<(f64, f64)>,
}

/// SVG (a complete `<svg>...</svg>` document) of NVLink GB/s (slowest rank,
/// 1 GB = 1e9 B) against tokens per rank. x is log2-scaled when the token
/// values span more than 8x (and none is 0), linear otherwise. One series per
/// op (ours solid, baselines dashed); when other case fields also vary, one
/// series per (op, those values). Ops that move no NVLink bytes (layout) are
/// left out. Errors when the sweep has fewer than 2 token values or nothing
/// to draw.
pub fn svg(results: &[CaseResult], title: &str) -> Result<String, String> {
    let mut tokens: Vec<usize> = results.iter().map(|r| r.case.tokens).collect();
    tokens.sort_unstable();
    tokens.dedup();
    if tokens.len() < 2 {
        return Err(format!(
            "plot: the sweep has {} token value(s); a line needs at least 2 (e.g. --tokens 1024,2048,4096)",
            tokens.len()
        ));
    }
    let others: Vec<CaseField> = varying_fields(results)
        .into_iter()
        .filter(|f| *f != CaseField::Tokens)
        .collect();

    // Group points into series, in order of first appearance.
    let mut series: Vec<Series> = Vec::new();
    for res in results {
        let suffix: Vec<String> = others
            .iter()
            .map(|f| format!("{}={}", f.name(), f.value(&res.case)))
            .collect();
        for op in &res.ops {
            let label = if suffix.is_empty() {
                op.op.clone()
            } else {
                format!("{} ({})", op.op, suffix.join(", "))
            };
            let y = op.nvlink_gbps();
            if op.slowest_rank().is_none() || !y.is_finite() {
                continue;
            }
            let point = (res.case.tokens as f64, y);
            match series.iter_mut().find(|s| s.label == label) {
                Some(s) => s.points.push(point),
                None => series.push(Series {
                    label,
                    baseline: !op.is_ours(),
                    points: vec![point],
                }),
            }
        }
    }
    series.retain(|s| s.points.iter().any(|&(_, y)| y > 0.0));
    if series.is_empty() {
        return Err("plot: nothing to draw (no op moved NVLink bytes)".to_string());
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }

    let x_min = tokens[0] as f64;
    let x_max = tokens[tokens.len() - 1] as f64;
    let log = x_min > 0.0 && x_max / x_min > 8.0;
    let (xl, xr) = if log {
        (x_min.log2().floor(), x_max.log2().ceil())
    } else {
        (x_min, x_max)
    };
    let y_top_raw = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let y_ticks = nice_ticks(0.0, y_top_raw * 1.05);
    let y_max = y_ticks
        .last()
        .copied()
        .unwrap_or(1.0)
        .max(f64::MIN_POSITIVE);

    // Room for the legend: ~7 px per character, one entry per 20 px.
    let longest = series
        .iter()
        .map(|s| s.label.chars().count())
        .max()
        .unwrap_or(0);
    let right = MIN_RIGHT.max(60.0 + 7.0 * longest as f64);
    let width = LEFT + PLOT_W + right;
    let height = MIN_HEIGHT.max(TOP + 8.0 + LEGEND_STEP * series.len() as f64 + BOTTOM);
    let pw = PLOT_W;
    let ph = height - TOP - BOTTOM;
    let sx = |x: f64| -> f64 {
        let t = if log { x.max(1.0).log2() } else { x };
        let span = xr - xl;
        LEFT + if span > 0.0 {
            (t - xl) / span * pw
        } else {
            pw / 2.0
        }
    };
    let sy = |y: f64| -> f64 { TOP + ph - (y / y_max).clamp(0.0, 1.0) * ph };

    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(o, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        o,
        "<text x=\"{}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">{}</text>",
        LEFT + pw / 2.0,
        xml_escape(title)
    );

    // Grid and y ticks.
    for &t in &y_ticks {
        let y = sy(t);
        let _ = writeln!(
            o,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e5e5e5\"/>",
            LEFT + pw
        );
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            LEFT - 6.0,
            y + 4.0,
            fmt_tick(t)
        );
    }
    // x ticks.
    let x_ticks: Vec<f64> = if log {
        let (a, b) = (xl as i32, xr as i32);
        (a..=b).map(|e| 2f64.powi(e)).collect()
    } else {
        nice_ticks(x_min, x_max)
            .into_iter()
            .filter(|&t| t >= x_min - 1e-9 && t <= x_max + 1e-9)
            .collect()
    };
    let label_every = x_ticks.len().div_ceil(12).max(1);
    for (i, &t) in x_ticks.iter().enumerate() {
        let x = sx(t);
        let _ = writeln!(
            o,
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#333\"/>",
            TOP + ph,
            TOP + ph + 5.0
        );
        if i % label_every == 0 {
            let _ = writeln!(
                o,
                "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                TOP + ph + 19.0,
                fmt_tick(t)
            );
        }
    }
    // Axes and axis titles.
    let _ = writeln!(
        o,
        "<line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{:.1}\" stroke=\"#333\"/>",
        TOP + ph
    );
    let _ = writeln!(
        o,
        "<line x1=\"{LEFT}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#333\"/>",
        TOP + ph,
        LEFT + pw,
        TOP + ph
    );
    let _ = writeln!(
        o,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">tokens per rank{}</text>",
        LEFT + pw / 2.0,
        height - 18.0,
        if log { " (log2 scale)" } else { "" }
    );
    let _ = writeln!(
        o,
        "<text transform=\"translate(18 {:.1}) rotate(-90)\" text-anchor=\"middle\">NVLink GB/s (slowest rank)</text>",
        TOP + ph / 2.0
    );

    // Series and legend.
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let dash = if s.baseline {
            " stroke-dasharray=\"6 4\""
        } else {
            ""
        };
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            o,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash} points=\"{}\"/>",
            pts.join(" ")
        );
        for &(x, y) in &s.points {
            let fill = if s.baseline { "white" } else { color };
            let _ = writeln!(
                o,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3.5\" fill=\"{fill}\" stroke=\"{color}\" stroke-width=\"1.5\">\
                 <title>{}: {} tokens, {:.1} GB/s</title></circle>",
                sx(x),
                sy(y),
                xml_escape(&s.label),
                x,
                y
            );
        }
        let ly = TOP + 8.0 + LEGEND_STEP * i as f64;
        let lx = LEFT + pw + 16.0;
        let _ = writeln!(
            o,
            "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>",
            lx + 28.0
        );
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            lx + 34.0,
            ly + 4.0,
            xml_escape(&s.label)
        );
    }
    o.push_str("</svg>\n");
    Ok(o)
}

/// Escapes `&`, `<`, `>`, `"` and `'` for SVG text and attributes; drops
/// control characters XML does not allow.
pub fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => {}
            c => out.push(c),
        }
    }
    out
}

/// About 5-8 round ticks (1, 2, 5 x 10^k steps) covering `[lo, hi]`.
fn nice_ticks(lo: f64, hi: f64) -> Vec<f64> {
    if !(lo.is_finite() && hi.is_finite()) || hi <= lo {
        return vec![lo.max(0.0), lo.max(0.0) + 1.0];
    }
    let raw = (hi - lo) / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).floor() * step;
    let mut ticks = Vec::new();
    let mut k = 0;
    loop {
        let t = first + step * k as f64;
        ticks.push(t);
        if t >= hi - step * 1e-9 || k > 100 {
            break;
        }
        k += 1;
    }
    ticks
}

/// Tick label: integers without decimals, `1.5`-style otherwise.
fn fmt_tick(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::sample;

    fn count(hay: &str, needle: &str) -> usize {
        hay.matches(needle).count()
    }

    /// Every `<tag` that is not self-closed has a matching `</tag>`.
    fn balanced(svg: &str) -> bool {
        let mut stack: Vec<String> = Vec::new();
        let mut rest = svg;
        while let Some(i) = rest.find('<') {
            rest = &rest[i + 1..];
            let end = match rest.find('>') {
                Some(e) => e,
                None => return false,
            };
            let tag = &rest[..end];
            if let Some(name) = tag.strip_prefix('/') {
                if stack.pop().as_deref() != Some(name.trim()) {
                    return false;
                }
            } else if !tag.ends_with('/') {
                let name = tag.split_whitespace().next().unwrap_or("").to_string();
                stack.push(name);
            }
            rest = &rest[end + 1..];
        }
        stack.is_empty()
    }

    #[test]
    fn one_series_per_op_linear() {
        let results: Vec<_> = [1024, 2048, 4096]
            .iter()
            .map(|&t| sample(t, 7168, None))
            .collect();
        let s = svg(&results, "dispatch <H200> & co").unwrap();
        assert!(s.starts_with("<svg"));
        assert!(s.trim_end().ends_with("</svg>"));
        assert!(balanced(&s), "{s}");
        // dispatch, combine, nccl-alltoall, peer-store-ceiling (layout has no bytes).
        assert_eq!(count(&s, "<polyline"), 4);
        assert_eq!(count(&s, "stroke-dasharray"), 2 * 2); // 2 baselines: line + legend
        assert_eq!(count(&s, "<circle"), 4 * 3);
        assert!(s.contains("dispatch &lt;H200&gt; &amp; co"));
        assert!(!s.contains("log2 scale"));
        assert!(s.contains(">peer-store-ceiling</text>"));
        assert!(s.contains("NVLink GB/s"));
    }

    #[test]
    fn log_scale_and_extra_series() {
        let mut results = Vec::new();
        for hidden in [4096, 7168] {
            for t in [128, 1024, 8192] {
                results.push(sample(t, hidden, None));
            }
        }
        let s = svg(&results, "sweep").unwrap();
        assert!(s.contains("log2 scale"));
        assert!(balanced(&s));
        assert_eq!(count(&s, "<polyline"), 8);
        assert!(s.contains("dispatch (hidden=4096)"));
        assert!(s.contains("dispatch (hidden=7168)"));
        // Power-of-two tick labels.
        assert!(s.contains(">128</text>") && s.contains(">8192</text>"));
    }

    #[test]
    fn legend_makes_room_for_long_labels() {
        let mut results = Vec::new();
        for (i, t) in [64, 128].iter().enumerate() {
            let mut r = sample(*t, 7168, None);
            r.ops[1].op = format!("dispatch-with-a-very-long-name-{i}");
            results.push(r);
        }
        let s = svg(&results, "x").unwrap();
        let width: f64 = s
            .split("width=\"")
            .nth(1)
            .and_then(|w| w.split('"').next())
            .and_then(|w| w.parse().ok())
            .unwrap();
        assert!(width > LEFT + PLOT_W + MIN_RIGHT, "{width}");
        // Each renamed op is its own series with a single point.
        assert_eq!(count(&s, "<polyline"), 5);
        assert!(balanced(&s));
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

    #[test]
    fn ticks() {
        let t = nice_ticks(0.0, 367.0);
        assert_eq!(t.first(), Some(&0.0));
        assert!(*t.last().unwrap() >= 367.0);
        assert!(t.len() >= 4 && t.len() <= 10, "{t:?}");
        assert_eq!(nice_ticks(0.0, 0.0), vec![0.0, 1.0]);
        assert_eq!(fmt_tick(250.0), "250");
        assert_eq!(fmt_tick(0.25), "0.25");
        assert_eq!(
            xml_escape("a<b>\"c\"&'\u{1}"),
            "a&lt;b&gt;&quot;c&quot;&amp;&apos;"
        );
    }
}
