//! The throughput–latency curves of a sweep as PNG: for one kind of load (a concurrency sweep or
//! a Poisson rate sweep), TTFT and inter-token latency (p50 solid, p90 light) against output
//! tokens/s, the disaggregated cluster beside the colocated engine, each point labelled with its
//! load. Text is drawn with an embedded DejaVu Sans, so no font needs to be installed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;

use crate::serving::Level;

/// One curve: a side's levels of one load kind, in the order they were run.
pub struct Side<'a> {
    /// "disaggregated" or "colocated".
    pub name: &'a str,
    pub levels: Vec<&'a Level>,
    pub color: RGBColor,
}

const FONT: &str = "sans-serif";
const WIDTH_PX: u32 = 1400;
const HEIGHT_PX: u32 = 560;

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // A fixed, valid TTF compiled in: failure here is a bug, not an input error.
        if plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_err() {
            panic!("the embedded DejaVu Sans did not load. This is a bug.");
        }
    });
}

/// (x = output tok/s, y = the metric in ms, label) per level.
type Points = Vec<(f64, f64, String)>;

fn points(levels: &[&Level], y: fn(&Level) -> f64) -> Points {
    levels.iter().map(|l| (l.output_tok_s, y(l), l.load().label())).collect()
}

/// Draws `sides` into `path` (PNG) under `title`.
pub fn curves(path: &Path, title: &str, sides: &[Side<'_>]) -> anyhow::Result<()> {
    register_font();
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    let root = BitMapBackend::new(path, (WIDTH_PX, HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, (FONT, 22)).map_err(|e| err(&e))?;
    let panels = root.split_evenly((1, 2));
    type Metric = (&'static str, fn(&Level) -> f64, fn(&Level) -> f64);
    let metrics: [Metric; 2] = [
        ("time to first token", |l| l.ttft_p50_ms, |l| l.ttft_p90_ms),
        ("inter-token latency", |l| l.itl_p50_ms, |l| l.itl_p90_ms),
    ];
    let all = || sides.iter().flat_map(|s| s.levels.iter());
    let x_max = all().map(|l| l.output_tok_s).fold(0.0, f64::max) * 1.15 + 1e-3;
    for (panel, (name, p50, p90)) in panels.iter().zip(metrics) {
        let y_max = all().map(|l| p90(l).max(p50(l))).fold(0.0, f64::max) * 1.15 + 1e-3;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{name} (p50 solid, p90 light)"), (FONT, 17))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("output tokens/s")
            .y_desc(format!("{name}, ms"))
            .axis_desc_style((FONT, 14))
            .label_style((FONT, 12))
            .draw()
            .map_err(|e| err(&e))?;
        for side in sides {
            let median = points(&side.levels, p50);
            let tail = points(&side.levels, p90);
            let light = side.color.mix(0.35);
            chart
                .draw_series(LineSeries::new(tail.iter().map(|p| (p.0, p.1)), light.stroke_width(1)))
                .map_err(|e| err(&e))?;
            chart
                .draw_series(tail.iter().map(|p| TriangleMarker::new((p.0, p.1), 4, light.filled())))
                .map_err(|e| err(&e))?;
            let color = side.color;
            chart
                .draw_series(LineSeries::new(median.iter().map(|p| (p.0, p.1)), color.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(side.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart
                .draw_series(median.iter().map(|p| Circle::new((p.0, p.1), 4, color.filled())))
                .map_err(|e| err(&e))?;
            chart
                .draw_series(median.iter().map(|p| Text::new(format!(" {}", p.2), (p.0, p.1), (FONT, 12))))
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::serving::{Load, Sample, Slo, summarize};

    fn level(c: usize, ttft_ms: u64) -> Level {
        let s = Sample { ttft: Duration::from_millis(ttft_ms), e2e: Duration::from_millis(ttft_ms + 630), tokens: 64 };
        summarize(Load::Concurrency(c), &vec![s; 4], Duration::from_secs(2), &Slo::default())
    }

    /// The PNG's width and height from its IHDR chunk, after checking the signature.
    fn png_size(bytes: &[u8]) -> (u32, u32) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
        assert_eq!(&bytes[12..16], b"IHDR");
        let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
        (be(16), be(20))
    }

    #[test]
    fn draws_both_sides_into_a_png() {
        let dir = std::env::temp_dir().join(format!("tandem-plot-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("curve.png");
        let (a, b) = ([level(1, 400), level(4, 900)], [level(1, 300), level(4, 700)]);
        let sides = [
            Side { name: "disaggregated", levels: a.iter().collect(), color: BLUE },
            Side { name: "colocated", levels: b.iter().collect(), color: RED },
        ];
        curves(&path, "test", &sides).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(png_size(&bytes), (WIDTH_PX, HEIGHT_PX));
        // A blank white 1400×560 image compresses to a few kB; axes, text and curves do not.
        assert!(bytes.len() > 20_000, "{} bytes: nothing drawn?", bytes.len());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
