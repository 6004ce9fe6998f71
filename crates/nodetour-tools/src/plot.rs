//! `--plot FILE.svg`: busbw against message size, one line per series (each path, NCCL), on a
//! log2 size axis. Plain SVG, no dependencies, readable in any browser.

use std::fmt::Write as _;

/// One line of the plot: a name and (bytes, GB/s) points.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// (size in bytes, busbw in GB/s), in size order.
    pub points: Vec<(usize, f64)>,
}

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;
const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#555555",
];

fn size_label(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// Renders the plot titled `title`.
pub fn svg(title: &str, series: &[Series]) -> String {
    let all: Vec<(usize, f64)> = series.iter().flat_map(|s| s.points.clone()).collect();
    let (xmin, xmax) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), (x, _)| {
        let l = (*x.max(&1) as f64).log2();
        (a.min(l), b.max(l))
    });
    let (xmin, xmax) = if all.is_empty() || xmax <= xmin {
        (0.0, 1.0)
    } else {
        (xmin, xmax)
    };
    let ymax = all.iter().map(|p| p.1).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let x = |b: usize| LEFT + ((b.max(1) as f64).log2() - xmin) / (xmax - xmin) * pw;
    let y = |v: f64| TOP + ph - v / ymax * ph;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="14" text-anchor="middle">{}</text>"#,
        LEFT + pw / 2.0,
        escape(title)
    );
    // Axes, grid and ticks.
    for i in 0..=5 {
        let v = ymax / 1.1 * f64::from(i) / 5.0;
        let yy = y(v);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{v:.0}</text>"##,
            LEFT + pw,
            LEFT - 6.0,
            yy + 4.0
        );
    }
    let mut sizes: Vec<usize> = all.iter().map(|p| p.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let step = sizes.len().div_ceil(10).max(1);
    for b in sizes.iter().step_by(step) {
        let xx = x(*b);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + ph,
            TOP + ph + 16.0,
            size_label(*b)
        );
    }
    let _ = writeln!(
        s,
        r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">message size (bytes per rank)</text>"#,
        LEFT + pw / 2.0,
        H - 18.0
    );
    let _ = writeln!(
        s,
        r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">busbw (GB/s)</text>"#,
        TOP + ph / 2.0,
        TOP + ph / 2.0
    );
    for (k, ser) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let pts: Vec<String> = ser
            .points
            .iter()
            .map(|(b, v)| format!("{:.1},{:.1}", x(*b), y(*v)))
            .collect();
        let _ = writeln!(
            s,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
            pts.join(" ")
        );
        for (b, v) in &ser.points {
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{colour}"/>"#,
                x(*b),
                y(*v)
            );
        }
        let ly = TOP + 10.0 + 20.0 * k as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            LEFT + pw + 12.0,
            LEFT + pw + 32.0,
            LEFT + pw + 38.0,
            ly + 4.0,
            escape(&ser.name)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plot_has_one_line_and_legend_entry_per_series() {
        let s = svg(
            "all_reduce <f32>",
            &[
                Series {
                    name: "direct".into(),
                    points: vec![(1 << 20, 50.0), (1 << 30, 340.0)],
                },
                Series {
                    name: "NCCL".into(),
                    points: vec![(1 << 20, 70.0), (1 << 30, 320.0)],
                },
            ],
        );
        assert!(s.starts_with("<svg"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains(">NCCL</text>") && s.contains("&lt;f32&gt;"));
        assert!(s.contains(">1G</text>") && s.contains(">1M</text>"));
        // An empty plot still renders.
        assert!(svg("empty", &[]).ends_with("</svg>\n"));
    }
}
