//! Training curves as one SVG (plotters): the loss over steps (training, and validation where measured)
//! on top, memory per step below (allocated at the end of each step, and the peak so far). `memfit train
//! --report run.json` writes it beside the report as `run.svg`.
//!
//! Losses that are not finite or beyond ±1e30 (a run that diverged) are left out, so the axis stays
//! finite (plotters cannot lay out an infinite range); steps need not be contiguous or sorted.

use crate::chart::{message_svg, trim_number, unit_for};
use memfit_memory::format_bytes;
use plotters::prelude::*;
use std::path::Path;

/// One training step as the trainer measured it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CurvePoint {
    pub step: usize,
    pub train_loss: Option<f64>,
    /// Validation loss, when the step was followed by an evaluation.
    pub val_loss: Option<f64>,
    /// Allocated bytes at the end of the step.
    pub allocated: u64,
    /// The most allocated at once up to the end of this step (the run's peak so far).
    pub peak_allocated: u64,
    /// Reserved bytes (the allocator's segments) at the end of the step.
    pub reserved: u64,
}

/// A run's curves and the figures its report gives, so the picture and the table say the same.
#[derive(Clone, Debug, PartialEq)]
pub struct Curves {
    pub points: Vec<CurvePoint>,
    /// The run's peaks (evaluation included), as its report gives them.
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// The device's capacity (`--memory`), drawn as a line.
    pub capacity: Option<u64>,
}

impl Curves {
    /// Curves whose peaks are the points' own (no capacity).
    pub fn of_points(points: Vec<CurvePoint>) -> Curves {
        let peak_allocated = points.iter().map(|p| p.peak_allocated.max(p.allocated)).max().unwrap_or(0);
        let peak_reserved = points.iter().map(|p| p.reserved).max().unwrap_or(0);
        Curves { points, peak_allocated, peak_reserved, capacity: None }
    }
}

/// Marks an SVG as memfit's training curves: an existing file without it is not replaced.
pub const CURVES_MARK: &str = "<!-- memfit training curves -->";

const SIZE: (u32, u32) = (1000, 640);
/// Losses beyond this magnitude are not drawn.
const MAX_LOSS: f64 = 1e30;
const FONT: &str = "sans-serif";
const TRAIN: RGBColor = RGBColor(0x4e, 0x79, 0xa7);
const VAL: RGBColor = RGBColor(0xe1, 0x57, 0x59);
const PEAK: RGBColor = RGBColor(0xc6, 0x28, 0x28);
const ALLOCATED: RGBColor = RGBColor(0x59, 0xa1, 0x4f);
const RESERVED: RGBColor = RGBColor(0x9c, 0x75, 0x5f);

pub fn curves_svg(curves: &Curves) -> String {
    if curves.points.is_empty() {
        return marked(message_svg(SIZE, "no training steps were recorded"));
    }
    let mut sorted = curves.clone();
    sorted.points.sort_by_key(|p| p.step);
    let mut svg = String::new();
    match draw(&sorted, &mut svg) {
        Ok(()) => marked(svg),
        Err(error) => marked(message_svg(SIZE, &format!("could not draw the curves: {error}"))),
    }
}

/// `svg` with [`CURVES_MARK`] just inside its root element.
fn marked(mut svg: String) -> String {
    let inside = svg.find("<svg").and_then(|at| svg[at..].find('>').map(|end| at + end + 1)).unwrap_or(0);
    svg.insert_str(inside, &format!("\n{CURVES_MARK}"));
    svg
}

pub fn write_curves(curves: &Curves, path: &Path) -> std::io::Result<()> {
    crate::write_file(path, curves_svg(curves))
}

fn draw(curves: &Curves, svg: &mut String) -> Result<(), Box<dyn std::error::Error>> {
    let points = &curves.points;
    let first = points.first().map_or(0, |p| p.step) as f64;
    let mut last = points.last().map_or(0, |p| p.step) as f64;
    if last <= first {
        last = first + 1.0;
    }
    // Whole steps only: a short run gets one label a step, not "1 1 1 2 2 2".
    let x_labels = ((last - first) as usize + 1).min(10);
    let step_label = |x: &f64| if x.fract() == 0.0 { format!("{x:.0}") } else { String::new() };
    let plottable = |loss: &f64| loss.abs() <= MAX_LOSS;
    let train: Vec<(f64, f64)> =
        points.iter().filter_map(|p| p.train_loss.filter(plottable).map(|l| (p.step as f64, l))).collect();
    let val: Vec<(f64, f64)> =
        points.iter().filter_map(|p| p.val_loss.filter(plottable).map(|l| (p.step as f64, l))).collect();

    let root = SVGBackend::with_string(svg, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(SIZE.1 * 55 / 100);

    // Loss.
    let losses = train.iter().chain(&val).map(|&(_, l)| l);
    let (low, high) = losses.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), l| (lo.min(l), hi.max(l)));
    let (low, high) = if low.is_finite() { (low, high) } else { (0.0, 1.0) };
    let pad = ((high - low) * 0.08).max(high.abs() * 0.02).max(1e-6);
    // Losses are usually non-negative: then the axis does not go below 0.
    let bottom_loss = if low >= 0.0 { (low - pad).max(0.0) } else { low - pad };
    let mut chart = ChartBuilder::on(&top)
        .caption("loss", (FONT, 18))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(34)
        .y_label_area_size(64)
        .build_cartesian_2d(first..last, bottom_loss..high + pad)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .label_style((FONT, 13))
        .x_desc("step")
        .y_desc("loss")
        .x_labels(x_labels)
        .x_label_formatter(&step_label)
        .y_label_formatter(&|y| trim_number(*y))
        .draw()?;
    if train.is_empty() && val.is_empty() {
        top.draw_text("no loss recorded", &TextStyle::from((FONT, 14)).color(&BLACK.mix(0.6)), (80, 60))?;
    }
    if !train.is_empty() {
        chart
            .draw_series(LineSeries::new(train.iter().copied(), TRAIN.stroke_width(2)))?
            .label("training loss")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], TRAIN.stroke_width(2)));
    }
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val.iter().copied(), VAL.stroke_width(2)).point_size(4))?
            .label("validation loss")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], VAL.stroke_width(2)));
    }
    if !(train.is_empty() && val.is_empty()) {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK.mix(0.2))
            .label_font((FONT, 13))
            .draw()?;
    }

    // Memory: the run's peaks as its report gives them, the reserved curve and the budget.
    let capacity = curves.capacity.unwrap_or(0);
    let most = points
        .iter()
        .map(|p| p.peak_allocated.max(p.allocated).max(p.reserved))
        .chain([curves.peak_allocated, curves.peak_reserved, capacity])
        .max()
        .unwrap_or(0)
        .max(1);
    let (unit, unit_name) = unit_for(most);
    let to_y = |bytes: u64| bytes as f64 / unit;
    let budget = curves.capacity.map_or(String::new(), |c| format!(" of a budget of {}", format_bytes(c)));
    let caption = format!(
        "memory per step (run's peak {} allocated, {} reserved{budget})",
        format_bytes(curves.peak_allocated),
        format_bytes(curves.peak_reserved)
    );
    let mut chart = ChartBuilder::on(&bottom)
        .caption(caption, (FONT, 18))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(34)
        .y_label_area_size(64)
        .build_cartesian_2d(first..last, 0.0..to_y(most) * 1.12)?;
    chart
        .configure_mesh()
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .label_style((FONT, 13))
        .x_desc("step")
        .y_desc(format!("bytes ({unit_name})"))
        .x_labels(x_labels)
        .x_label_formatter(&step_label)
        .y_label_formatter(&|y| trim_number(*y))
        .draw()?;
    if let Some(c) = curves.capacity {
        chart
            .draw_series(LineSeries::new([(first, to_y(c)), (last, to_y(c))], BLACK.stroke_width(1)))?
            .label("budget (--memory)")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK.stroke_width(1)));
    }
    let memory_curves: [(fn(&CurvePoint) -> u64, RGBColor, &str); 3] = [
        (|p| p.reserved, RESERVED, "reserved at the end of the step"),
        (|p| p.peak_allocated, PEAK, "peak allocated so far"),
        (|p| p.allocated, ALLOCATED, "allocated at the end of the step"),
    ];
    for (bytes, color, label) in memory_curves {
        chart
            .draw_series(LineSeries::new(
                points.iter().map(|p| (p.step as f64, to_y(bytes(p)))),
                color.stroke_width(2),
            ))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.2))
        .label_font((FONT, 13))
        .draw()?;
    root.present()?;
    Ok(())
}
