//! The interactivity-vs-throughput-per-worker Pareto plot, as SVG and PNG.
//!
//! One series per policy (or endpoint), one point per load level, joined in level order.
//! plotters draws the SVG (its bitmap backend would need C font libraries to draw text); the
//! PNG is rendered from that SVG with resvg, using the system's fonts.

use std::path::Path;

use plotters::prelude::*;

use crate::error::ReplayError;
use crate::metrics::Summary;

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn err(e: impl std::fmt::Display) -> ReplayError {
    ReplayError::Report(format!("plot: {e}"))
}

/// Draws the plot of `runs` into `path`.
pub fn pareto_svg(
    path: &Path,
    title: &str,
    level_kind: &str,
    runs: &[Summary],
) -> Result<(), ReplayError> {
    let mut labels: Vec<&str> = Vec::new();
    for r in runs {
        if !labels.contains(&r.label.as_str()) {
            labels.push(&r.label);
        }
    }
    let max_x = runs
        .iter()
        .map(|r| r.output_tok_s_per_worker)
        .fold(1.0, f64::max)
        * 1.15;
    let max_y = runs
        .iter()
        .map(|r| r.interactivity_tok_s)
        .fold(1.0, f64::max)
        * 1.15;
    let root = SVGBackend::new(path, (900, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_x, 0.0..max_y)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("output tokens/s per worker")
        .y_desc("interactivity: output tokens/s per user (1/TPOT)")
        .draw()
        .map_err(err)?;
    for (i, label) in labels.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut points: Vec<&Summary> = runs.iter().filter(|r| r.label == *label).collect();
        points.sort_by(|a, b| a.level.total_cmp(&b.level));
        let xy: Vec<(f64, f64)> = points
            .iter()
            .map(|r| (r.output_tok_s_per_worker, r.interactivity_tok_s))
            .collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), colour.stroke_width(2)))
            .map_err(err)?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        chart
            .draw_series(xy.iter().map(|&p| Circle::new(p, 4, colour.filled())))
            .map_err(err)?;
        chart
            .draw_series(points.iter().map(|r| {
                Text::new(
                    format!("{}={}", level_kind, r.level),
                    (r.output_tok_s_per_worker, r.interactivity_tok_s),
                    ("sans-serif", 11),
                )
            }))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Renders the SVG at `svg` into a PNG at `png`.
pub fn svg_to_png(svg: &Path, png: &Path) -> Result<(), ReplayError> {
    use resvg::{tiny_skia, usvg};
    let data = std::fs::read(svg).map_err(|e| ReplayError::io(svg, e))?;
    let mut options = usvg::Options::default();
    let fonts = options.fontdb_mut();
    fonts.load_system_fonts();
    // plotters asks for "sans-serif"; fontdb maps that to Arial unless told otherwise.
    let sans = fonts
        .faces()
        .filter_map(|face| face.families.first().map(|(name, _)| name.clone()))
        .find(|name| ["DejaVu Sans", "Liberation Sans", "Noto Sans"].contains(&name.as_str()));
    if let Some(family) = sans {
        fonts.set_sans_serif_family(family);
    }
    let tree = usvg::Tree::from_data(&data, &options).map_err(err)?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| err("the plot has no area"))?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap.save_png(png).map_err(err)
}
