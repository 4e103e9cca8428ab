//! The memory-over-time chart of the HTML page, drawn with plotters' SVG backend: allocated bytes
//! stacked by category (one colour per category everywhere, see [`category_color`]), reserved bytes
//! as a line over them, the capacity as a dashed line when it is in view, phases shaded as labelled
//! background bands, the peak marked and labelled, out-of-memory events marked at the top. Beside
//! the SVG it returns the data the page's hover read-out needs (plot position, downsampled points).
//!
//! The x axis is time (ms since the device started) on a device that computes; on `meta`, where time
//! measures nothing but bookkeeping, it is the allocator event number.
//!
//! Long recordings are downsampled to at most [`MAX_POINTS`] events: per bucket the lowest and the
//! highest allocated value, and the peak always. Memory is a step function and is drawn as one.
//!
//! Each block is stacked in the category in force at each moment: the replay (`analysis`) moves its
//! bytes from one area to another at its Retag events.
//!
//! Phase bands come from the events that carry the phase of the moment (Alloc, SegmentAlloc,
//! SegmentFree, Oom); a Free or a Retag carries the phase of its block's allocation, so it continues
//! the current band.
//! A band narrower than a pixel joins the one before; when the phases change so often that bands
//! would average under [`MIN_BAND_PX`] (hundreds of steps), none is drawn and the page says so.

use crate::analysis::Analysis;
use crate::{saturating_sum, Recording};
use memfit_memory::{format_bytes, Category, EventKind, Phase};
use plotters::prelude::*;
use plotters::style::text_anchor;
use serde_json::{json, Value};
use std::collections::HashMap;

/// Most events drawn (and handed to the hover read-out).
pub(crate) const MAX_POINTS: usize = 2000;

/// Phase bands are shaded only when they average at least this many pixels.
const MIN_BAND_PX: f64 = 4.0;

/// Stacking order, bottom to top: long-lived state first, then what a step adds.
pub(crate) const STACK: [Category; Category::COUNT] = [
    Category::Parameter,
    Category::OptimizerState,
    Category::Gradient,
    Category::Input,
    Category::Activation,
    Category::Temporary,
    Category::Communication,
    Category::Other,
];

pub(crate) const PHASES: [Phase; 7] =
    [Phase::Setup, Phase::Data, Phase::Forward, Phase::Backward, Phase::Optimizer, Phase::Eval, Phase::Rehearsal];

/// Each category's colour (Tableau 10), the same in the chart, the legend and the tables.
pub(crate) fn category_color(category: Category) -> RGBColor {
    match category {
        Category::Parameter => RGBColor(0x4e, 0x79, 0xa7),
        Category::OptimizerState => RGBColor(0xb0, 0x7a, 0xa1),
        Category::Gradient => RGBColor(0xf2, 0x8e, 0x2b),
        Category::Input => RGBColor(0x76, 0xb7, 0xb2),
        Category::Activation => RGBColor(0x59, 0xa1, 0x4f),
        Category::Temporary => RGBColor(0xed, 0xc9, 0x48),
        Category::Communication => RGBColor(0xe1, 0x57, 0x59),
        Category::Other => RGBColor(0x9c, 0x75, 0x5f),
    }
}

/// A phase's background band colour (light tints).
pub(crate) fn phase_color(phase: Phase) -> RGBColor {
    match phase {
        Phase::Setup => RGBColor(0xee, 0xee, 0xee),
        Phase::Data => RGBColor(0xe3, 0xf2, 0xfd),
        Phase::Forward => RGBColor(0xe8, 0xf5, 0xe9),
        Phase::Backward => RGBColor(0xfd, 0xec, 0xdc),
        Phase::Optimizer => RGBColor(0xf3, 0xe5, 0xf5),
        Phase::Eval => RGBColor(0xff, 0xf8, 0xd6),
        Phase::Rehearsal => RGBColor(0xf5, 0xf5, 0xf5),
    }
}

pub(crate) fn hex(color: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", color.0, color.1, color.2)
}

pub(crate) struct MemoryChart {
    pub svg: String,
    /// False when phases changed too often to shade them readably (then no band is drawn).
    pub phases_shaded: bool,
    /// The categories drawn (that held bytes at some event), in stacking order: the legend's.
    pub categories: Vec<Category>,
    /// Whether the capacity line is in view (it is left out when far above the data).
    pub capacity_drawn: bool,
    /// For the hover read-out; `Value::Null` when there is nothing to read.
    pub hover: Value,
}

const FONT: &str = "sans-serif";
const INK: RGBColor = RGBColor(0x33, 0x33, 0x33);
const RESERVED: RGBColor = RGBColor(0x22, 0x22, 0x22);
const ALERT: RGBColor = RGBColor(0xc6, 0x28, 0x28);

pub(crate) fn memory_chart(recording: &Recording, analysis: &Analysis, size: (u32, u32)) -> MemoryChart {
    let mut svg = String::new();
    let drawn = draw(recording, analysis, size, &mut svg);
    match drawn {
        Ok(Drawn { hover, phases_shaded, categories, capacity_drawn }) => {
            MemoryChart { svg, phases_shaded, categories, capacity_drawn, hover }
        }
        Err(error) => MemoryChart {
            svg: message_svg(size, &format!("could not draw the chart: {error}")),
            phases_shaded: false,
            categories: Vec::new(),
            capacity_drawn: false,
            hover: Value::Null,
        },
    }
}

/// An SVG of the given size saying `text` (for empty recordings and drawing errors).
pub(crate) fn message_svg(size: (u32, u32), text: &str) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        let drawn = root.fill(&WHITE).and_then(|_| {
            let style = TextStyle::from((FONT, 16).into_font())
                .color(&INK)
                .pos(text_anchor::Pos::new(text_anchor::HPos::Center, text_anchor::VPos::Center));
            root.draw_text(text, &style, (size.0 as i32 / 2, size.1 as i32 / 2))
        });
        if drawn.and_then(|_| root.present()).is_err() {
            return String::new();
        }
    }
    svg
}

type DrawResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The x axis: time in ms or event number.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Axis {
    Time,
    Events,
}

/// What `draw` tells the page besides the SVG.
struct Drawn {
    hover: Value,
    phases_shaded: bool,
    categories: Vec<Category>,
    capacity_drawn: bool,
}

fn draw(recording: &Recording, analysis: &Analysis, size: (u32, u32), svg: &mut String) -> DrawResult<Drawn> {
    let events = &recording.events;
    if events.is_empty() {
        *svg = message_svg(size, "no allocator events were recorded");
        return Ok(Drawn { hover: Value::Null, phases_shaded: false, categories: Vec::new(), capacity_drawn: false });
    }
    let last = events.len() - 1;
    let spread = events[last].1 > events[0].1;
    let axis = if recording.device != "meta" && spread { Axis::Time } else { Axis::Events };
    let x_of = |index: usize| match axis {
        Axis::Time => events[index].1 as f64 / 1e6,
        Axis::Events => (index as u64).saturating_add(recording.dropped_events) as f64,
    };
    // Times only go forward in a real recording; the range holds every event whatever the input.
    let (x0, mut x1) =
        (0..events.len()).map(x_of).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }

    let series = analysis.category_series();
    let peak = analysis.peak;
    let keep = downsample(events.len(), |i| events[i].0.allocated, peak.map(|p| p.index), MAX_POINTS);

    // The y unit: the binary unit that keeps the axis labels short.
    let data_max = events.iter().map(|(e, _)| e.allocated.max(e.reserved)).max().unwrap_or(0);
    let capacity = recording.capacity.filter(|&c| c > 0 && (c as f64) <= data_max as f64 * 1.6 + 1.0);
    let top_bytes = data_max.max(capacity.unwrap_or(0)).max(1);
    let (unit, unit_name) = unit_for(top_bytes);
    let y_max = top_bytes as f64 / unit * 1.14;
    let to_y = |bytes: u64| bytes as f64 / unit;

    let root = SVGBackend::with_string(svg, size).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .margin_top(8)
        .margin_right(24)
        .margin_left(8)
        .x_label_area_size(44)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, 0.0..y_max)?;
    let x_desc = match axis {
        Axis::Time => "time since the device started (ms)",
        Axis::Events => "allocator event",
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.08))
        .axis_style(INK.mix(0.6))
        .y_labels(8)
        .x_labels(12)
        .label_style((FONT, 13).into_font().color(&INK))
        .axis_desc_style((FONT, 14).into_font().color(&INK))
        .x_desc(x_desc)
        .y_desc(format!("bytes ({unit_name})"))
        .x_label_formatter(&|x| trim_number(*x))
        .y_label_formatter(&|y| trim_number(*y))
        .draw()?;

    // Phase bands (behind everything), unless there are so many that they would be a blur: on
    // average narrower than MIN_BAND_PX.
    let (plot_x, plot_y) = chart.plotting_area().get_pixel_range();
    let plot_width = (plot_x.end - plot_x.start).max(1) as f64;
    let px_per_x = plot_width / (x1 - x0);
    let mut bands = phase_bands(recording, &x_of, x1, 1.0 / px_per_x);
    let phases_shaded = bands.len() as f64 * MIN_BAND_PX <= plot_width;
    if !phases_shaded {
        bands.clear();
    }
    chart.draw_series(
        bands.iter().map(|band| Rectangle::new([(band.x0, 0.0), (band.x1, y_max)], phase_color(band.phase).filled())),
    )?;

    // Allocated bytes stacked by category: each layer is the running sum up to it, drawn from the top
    // layer down so lower layers paint over higher ones.
    let present: Vec<Category> =
        STACK.iter().copied().filter(|c| series.iter().any(|values| values[c.index()] > 0)).collect();
    for depth in (0..present.len()).rev() {
        let layer = &present[..=depth];
        let value = |i: usize| saturating_sum(layer.iter().map(|c| series[i][c.index()]));
        let color = category_color(present[depth]);
        chart.draw_series(
            AreaSeries::new(steps(&keep, &x_of, |i| to_y(value(i))), 0.0, color.filled()).border_style(color),
        )?;
    }
    chart
        .draw_series(LineSeries::new(steps(&keep, &x_of, |i| to_y(events[i].0.reserved)), RESERVED.stroke_width(2)))?;

    if let Some(capacity) = capacity {
        let y = to_y(capacity);
        chart.draw_series(DashedLineSeries::new([(x0, y), (x1, y)], 8, 5, ALERT.stroke_width(2)))?;
        let label = format!("capacity {}", format_bytes(capacity));
        let style = TextStyle::from((FONT, 13).into_font())
            .color(&ALERT)
            .pos(text_anchor::Pos::new(text_anchor::HPos::Left, text_anchor::VPos::Bottom));
        chart.draw_series(std::iter::once(EmptyElement::at((x0, y)) + Text::new(label, (6, -3), style)))?;
    }

    // Phase labels on top of the areas, where the band is wide enough to hold one.
    let label_color = INK.mix(0.75);
    let label_style = TextStyle::from((FONT, 12).into_font())
        .color(&label_color)
        .pos(text_anchor::Pos::new(text_anchor::HPos::Center, text_anchor::VPos::Top));
    chart.draw_series(
        bands.iter().filter(|band| (band.x1 - band.x0) * px_per_x >= 6.5 * band.phase.name().len() as f64 + 4.0).map(
            |band| {
                EmptyElement::at(((band.x0 + band.x1) / 2.0, y_max))
                    + Text::new(band.phase.name().to_string(), (0, 4), label_style.clone())
            },
        ),
    )?;

    // Out-of-memory events: a red triangle at the top.
    let ooms: Vec<usize> = (0..events.len()).filter(|&i| events[i].0.kind == EventKind::Oom).collect();
    let oom_style = TextStyle::from((FONT, 11).into_font())
        .color(&ALERT)
        .pos(text_anchor::Pos::new(text_anchor::HPos::Center, text_anchor::VPos::Top));
    chart.draw_series(ooms.iter().map(|&i| {
        EmptyElement::at((x_of(i), y_max))
            + TriangleMarker::new((0, 22), 6, ALERT.filled())
            + Text::new("OOM", (0, 30), oom_style.clone())
    }))?;

    // The peak: a line down to the axis, a dot and its bytes.
    if let Some(peak) = peak {
        let (x, y) = (x_of(peak.index), to_y(peak.event.allocated));
        chart.draw_series(LineSeries::new([(x, 0.0), (x, y)], ALERT.mix(0.7).stroke_width(1)))?;
        let text = format!("peak {}", format_bytes(peak.event.allocated));
        let module = recording.module_name(peak.event.module);
        let detail =
            if module.is_empty() { peak.event.op.to_string() } else { format!("{} · {module}", peak.event.op) };
        let width = 7 * text.len().max(detail.len()) as i32 + 12;
        let (pixel_x, _) = chart.backend_coord(&(x, y));
        // Keep the label inside the plot: to the left of the dot when the dot is near the right edge.
        let dx = if pixel_x.saturating_add(width + 12) > plot_x.end { -(width + 10) } else { 10 };
        let bold = TextStyle::from((FONT, 14).into_font().style(FontStyle::Bold)).color(&ALERT);
        let small = TextStyle::from((FONT, 12).into_font()).color(&INK);
        chart.draw_series(std::iter::once(
            EmptyElement::at((x, y))
                + Rectangle::new([(dx - 4, -40), (dx + width, -4)], WHITE.mix(0.85).filled())
                + Circle::new((0, 0), 5, ALERT.filled())
                + Circle::new((0, 0), 8, ALERT.stroke_width(2))
                + Text::new(text, (dx + 2, -38), bold)
                + Text::new(detail, (dx + 2, -20), small),
        ))?;
    }
    root.present()?;

    let hover = hover_data(recording, &keep, &series, &x_of, axis, (plot_x, plot_y), size, (x0, x1));
    Ok(Drawn { hover, phases_shaded, categories: present, capacity_drawn: capacity.is_some() })
}

/// A phase band [x0, x1).
struct Band {
    phase: Phase,
    x0: f64,
    x1: f64,
}

/// Runs of events in one phase, as x ranges; bands narrower than `min_width` join the band before.
fn phase_bands(recording: &Recording, x_of: &dyn Fn(usize) -> f64, x_end: f64, min_width: f64) -> Vec<Band> {
    let mut starts: Vec<(Phase, f64)> = Vec::new();
    for (index, (event, _)) in recording.events.iter().enumerate() {
        if matches!(event.kind, EventKind::Free | EventKind::Retag) {
            continue;
        }
        if !matches!(starts.last(), Some(&(phase, _)) if phase == event.phase) {
            starts.push((event.phase, x_of(index)));
        }
    }
    let mut bands: Vec<Band> = Vec::new();
    for (n, &(phase, x0)) in starts.iter().enumerate() {
        let x0 = if n == 0 { x_of(0) } else { x0 };
        let x1 = starts.get(n + 1).map_or(x_end, |&(_, next)| next);
        match bands.last_mut() {
            Some(last) if x1 - x0 < min_width => last.x1 = x1,
            Some(last) if last.phase == phase => last.x1 = x1,
            _ => bands.push(Band { phase, x0, x1 }),
        }
    }
    bands
}

/// The events to draw, in order: all of them when there are at most `max`, else per bucket the lowest
/// and highest `value` (the peak in its bucket), and always the first and the last.
pub(crate) fn downsample(len: usize, value: impl Fn(usize) -> u64, peak: Option<usize>, max: usize) -> Vec<usize> {
    if len <= max.max(4) {
        return (0..len).collect();
    }
    let buckets = (max / 2).saturating_sub(1).max(1);
    let width = len.div_ceil(buckets);
    let mut keep = vec![0];
    let mut start = 0;
    while start < len {
        let end = (start + width).min(len);
        let low = (start..end).min_by_key(|&i| value(i)).unwrap_or(start);
        let mut high = (start..end).max_by_key(|&i| value(i)).unwrap_or(start);
        if let Some(peak) = peak.filter(|p| (start..end).contains(p)) {
            high = peak;
        }
        for i in [low.min(high), low.max(high)] {
            if keep.last() != Some(&i) {
                keep.push(i);
            }
        }
        start = end;
    }
    if keep.last() != Some(&(len - 1)) {
        keep.push(len - 1);
    }
    keep
}

/// A step function through the kept events: each value holds until the next event.
fn steps(keep: &[usize], x_of: &dyn Fn(usize) -> f64, value: impl Fn(usize) -> f64) -> Vec<(f64, f64)> {
    let mut points = Vec::with_capacity(2 * keep.len());
    let mut previous = None;
    for &i in keep {
        let (x, y) = (x_of(i), value(i));
        if let Some(before) = previous {
            points.push((x, before));
        }
        points.push((x, y));
        previous = Some(y);
    }
    points
}

/// Bytes per unit and its name, for the largest value shown.
pub(crate) fn unit_for(bytes: u64) -> (f64, &'static str) {
    const UNITS: [(f64, &str); 5] =
        [(1.0, "B"), (1024.0, "KiB"), (1048576.0, "MiB"), (1073741824.0, "GiB"), (1099511627776.0, "TiB")];
    UNITS.iter().rev().find(|(scale, _)| bytes as f64 >= 2.0 * scale).copied().unwrap_or(UNITS[0])
}

/// An axis label: at most three decimals, without trailing zeros.
pub(crate) fn trim_number(x: f64) -> String {
    let text = format!("{x:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".to_string()
    } else {
        text.to_string()
    }
}

/// What the page's script needs to say what is under the mouse: where the plot is in the SVG, the x
/// range, and per kept event [x, allocated, reserved, phase, what happened, bytes per category].
#[allow(clippy::too_many_arguments)]
fn hover_data(
    recording: &Recording,
    keep: &[usize],
    series: &[[u64; Category::COUNT]],
    x_of: &dyn Fn(usize) -> f64,
    axis: Axis,
    (plot_x, plot_y): (std::ops::Range<i32>, std::ops::Range<i32>),
    size: (u32, u32),
    (x0, x1): (f64, f64),
) -> Value {
    let mut labels: Vec<String> = Vec::new();
    let mut label_ids: HashMap<String, usize> = HashMap::new();
    let points: Vec<Value> = keep
        .iter()
        .map(|&i| {
            let event = recording.events[i].0;
            let label = event_label(recording, &event);
            let next = label_ids.len();
            let id = *label_ids.entry(label.clone()).or_insert_with(|| {
                labels.push(label);
                next
            });
            let phase = PHASES.iter().position(|&p| p == event.phase).unwrap_or(0);
            let by_category: Vec<u64> = STACK.iter().map(|c| series[i][c.index()]).collect();
            json!([x_of(i), event.allocated, event.reserved, phase, id, by_category])
        })
        .collect();
    json!({
        "width": size.0,
        "height": size.1,
        "plot": [plot_x.start, plot_x.end, plot_y.start, plot_y.end],
        "x": [x0, x1],
        "time": axis == Axis::Time,
        "phases": PHASES.iter().map(|p| p.name()).collect::<Vec<_>>(),
        "categories": STACK.iter().map(|c| c.name()).collect::<Vec<_>>(),
        "colors": STACK.iter().map(|&c| hex(category_color(c))).collect::<Vec<_>>(),
        "labels": labels,
        "points": points,
    })
}

/// "alloc 1.00 MiB conv2d · conv1 (activation)" and the like.
fn event_label(recording: &Recording, event: &memfit_memory::Event) -> String {
    let module = recording.module_name(event.module);
    let place = if module.is_empty() { String::new() } else { format!(" · {module}") };
    let bytes = format_bytes(event.bytes);
    match event.kind {
        EventKind::Alloc => format!("alloc {bytes} by {}{place} ({})", event.op, event.category),
        EventKind::Free => format!("free {bytes} from {}{place} ({})", event.op, event.category),
        EventKind::SegmentAlloc => format!("new segment {bytes} for {}{place}", event.op),
        EventKind::SegmentFree => format!("segment {bytes} released ({})", event.op),
        EventKind::SegmentMap => format!("expandable segment grows by {bytes} for {}{place}", event.op),
        EventKind::SegmentUnmap => format!("expandable segment gives back {bytes} ({})", event.op),
        EventKind::Oom => format!("OUT OF MEMORY asking {bytes} for {}{place} ({})", event.op, event.category),
        EventKind::Retag => format!("re-tag {bytes} from {}{place} as {}", event.op, event.category),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsampling_keeps_the_ends_and_the_peak_and_stays_bounded() {
        let values: Vec<u64> = (0..10_000u64).map(|i| (i * 7919) % 1000).collect();
        let peak = 4321;
        let keep = downsample(values.len(), |i| if i == peak { 5000 } else { values[i] }, Some(peak), 200);
        assert!(keep.len() <= 202, "{}", keep.len());
        assert_eq!(keep[0], 0);
        assert_eq!(*keep.last().unwrap(), 9999);
        assert!(keep.contains(&peak));
        assert!(keep.windows(2).all(|w| w[0] < w[1]), "in order, no repeats");
        assert_eq!(downsample(3, |i| i as u64, None, 200), vec![0, 1, 2]);
        assert!(downsample(0, |_| 0, None, 200).is_empty());
    }

    #[test]
    fn units_and_labels_read_well() {
        assert_eq!(unit_for(0).1, "B");
        assert_eq!(unit_for(3 << 20).1, "MiB");
        assert_eq!(unit_for(1500 << 10).1, "KiB");
        assert_eq!(trim_number(2.5), "2.5");
        assert_eq!(trim_number(40.0), "40");
        assert_eq!(trim_number(-0.0001), "0");
    }
}
