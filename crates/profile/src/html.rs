//! The recording as ONE self-contained HTML page (inline CSS and SVG, a few lines of inline script for
//! the hover read-out; nothing fetched from the network): the summary numbers as cards, the memory
//! chart (`chart`), a legend, then the largest allocations live at the peak (with their category at
//! the peak) and the memory table by category. Laid out for a 1400x900 window: the numbers and the chart fit in the first screen.

use crate::analysis::{Analysis, CategoryNote, Lifetime};
use crate::chart::{category_color, hex, memory_chart, phase_color, PHASES};
use crate::summary::{category_rows, dropped_note, fragmentation, or_dash};
use crate::{saturating_sum, Recording};
use memfit_memory::{format_bytes, EventKind};
use std::fmt::Write;
use std::path::Path;

/// Chart size in SVG pixels (the page scales it to its width).
const CHART: (u32, u32) = (1352, 470);
/// Rows of the table of allocations live at the peak.
const TOP: usize = 20;

pub fn html(recording: &Recording) -> String {
    let analysis = Analysis::of(recording);
    let chart = memory_chart(recording, &analysis, CHART);
    let stats = &recording.stats;
    let title = if recording.title.is_empty() { "memfit memory profile" } else { recording.title.as_str() };

    let mut page = String::with_capacity(chart.svg.len() + 64 * 1024);
    let _ = write!(
        page,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>memory: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(title)
    );

    // Header.
    let capacity = recording.capacity.map_or("unlimited".to_string(), format_bytes);
    let device = if recording.device.is_empty() { "?" } else { recording.device.as_str() };
    let _ = writeln!(
        page,
        "<header><h1>{}</h1><p class=\"sub\">{} device · capacity {} · {} allocator events{} · {} modules · {} spans</p></header>",
        escape(title),
        escape(device),
        escape(&capacity),
        recording.events.len(),
        escape(&dropped_note(recording)),
        recording.modules.iter().filter(|m| !m.is_empty()).count(),
        recording.spans.len()
    );

    // The numbers.
    page.push_str("<section class=\"cards\">\n");
    let peak = analysis.peak;
    let peak_detail = match peak {
        Some(p) if p.event.allocated == stats.allocated_bytes.peak => {
            format!("at {} in {}", when(recording, p.index), p.event.phase)
        }
        Some(p) => format!("before the recorded events; {} at most in them", format_bytes(p.event.allocated)),
        None => "no allocation recorded".to_string(),
    };
    card(&mut page, "peak allocated", &format_bytes(stats.allocated_bytes.peak), &peak_detail, true);
    card(
        &mut page,
        "peak reserved",
        &format_bytes(stats.reserved_bytes.peak),
        &format!("{} at the end", format_bytes(stats.reserved_bytes.current)),
        false,
    );
    let used = recording.capacity.filter(|&c| c > 0).map_or("no limit set".to_string(), |c| {
        format!("{:.1}% reserved at the peak", 100.0 * stats.reserved_bytes.peak as f64 / c as f64)
    });
    card(&mut page, "capacity", &capacity, &used, false);
    card(
        &mut page,
        "fragmentation",
        &format!("{:.1}%", fragmentation(recording) * 100.0),
        "of the reserved peak never in use",
        false,
    );
    match peak {
        Some(p) => {
            let module = recording.module_name(p.event.module);
            let place = if module.is_empty() { String::new() } else { format!("{module} · ") };
            let detail = format!("{place}{} {} · {}", format_bytes(p.event.bytes), p.event.category, p.event.phase);
            card(&mut page, "the peak was made by", p.event.op, &detail, false);
        }
        None => card(&mut page, "the peak was made by", "-", "no allocation recorded", false),
    }
    let ooms = recording.events.iter().filter(|(e, _)| e.kind == EventKind::Oom).count();
    card(
        &mut page,
        "out of memory",
        &stats.num_ooms.to_string(),
        &format!("{ooms} in the events, {} injected", stats.num_injected_faults),
        stats.num_ooms > 0,
    );
    page.push_str("</section>\n");

    // The chart and its legend.
    page.push_str("<section class=\"panel\">\n<div class=\"legend\">");
    for category in &chart.categories {
        let _ = write!(
            page,
            "<span><i style=\"background:{}\"></i>{}</span>",
            hex(category_color(*category)),
            category.name()
        );
    }
    page.push_str("<span><i class=\"line\"></i>reserved</span>");
    // A capacity far above the data is left out of the chart (its card gives the share in use).
    if chart.capacity_drawn {
        page.push_str("<span><i class=\"line dash\"></i>capacity</span>");
    }
    if chart.phases_shaded {
        page.push_str("<span class=\"sep\">phases:</span>");
        for phase in PHASES.iter().filter(|p| recording.events.iter().any(|(e, _)| e.phase == **p)) {
            let _ = write!(
                page,
                "<span><i class=\"band\" style=\"background:{}\"></i>{}</span>",
                hex(phase_color(*phase)),
                phase.name()
            );
        }
    } else if !recording.events.is_empty() {
        page.push_str("<span class=\"sep\">phases change too often to shade (hover for the phase)</span>");
    }
    page.push_str("</div>\n<div id=\"chart\" class=\"chart\">");
    // Inline SVG needs no namespace declaration; leaving it out keeps the page free of any URL.
    page.push_str(&chart.svg.replacen(" xmlns=\"http://www.w3.org/2000/svg\"", "", 1));
    page.push_str(
        "<div id=\"cursor\" class=\"cursor\" hidden></div><div id=\"tip\" class=\"tip\" hidden></div></div>\n",
    );
    // Only a truncated timeline leaves categories unknown (see Note [Replaying a recording]).
    let unknown = analysis.unknown_category_bytes();
    if unknown > 0 {
        let _ = writeln!(
            page,
            "<p class=\"note\">Categories over time are approximate for {}: blocks allocated before the recorded \
             events and re-tagged in them (an output saved for backward, a buffer reused for a gradient). What they \
             were before that re-tag is not recorded, so until then the areas count them in the category they were \
             re-tagged to{}. Everything else, and <b>Memory by category</b>, is exact.</p>",
            format_bytes(unknown),
            match analysis.unknown_at_peak() {
                0 => String::new(),
                at_peak => format!(" ({} of them at the peak, marked ? below)", format_bytes(at_peak)),
            }
        );
    }
    page.push_str("</section>\n");

    // Below: what was live at the peak, and the table by category.
    page.push_str("<section class=\"columns\">\n<div class=\"panel wide\">\n");
    let live = analysis.live_at_peak();
    let live_total = saturating_sum(live.iter().map(|l| l.size));
    let _ = write!(
        page,
        "<h2>Largest allocations live at the peak</h2>\n<p class=\"note\">{} allocations, {} in all{}</p>\n",
        live.len(),
        format_bytes(live_total),
        if live.len() > TOP { format!("; the {TOP} largest:") } else { String::new() }
    );
    if live.is_empty() {
        page.push_str("<p class=\"note\">No allocation was live at a recorded peak.</p>\n");
    } else {
        page.push_str(
            "<table><thead><tr><th class=\"num\">size</th><th class=\"num\">of peak</th><th>category</th><th>op</th>\
             <th>module</th><th>phase</th><th class=\"num\">allocated at</th></tr></thead><tbody>\n",
        );
        let (peak_index, peak_bytes) = peak.map_or((0, 0), |p| (p.index, p.event.allocated));
        for lifetime in live.iter().take(TOP) {
            live_row(&mut page, recording, lifetime, peak_index, peak_bytes.max(1));
        }
        page.push_str("</tbody></table>\n");
    }
    page.push_str("</div>\n<div class=\"panel\">\n<h2>Memory by category</h2>\n");
    let rows = category_rows(recording);
    if rows.is_empty() {
        page.push_str("<p class=\"note\">Nothing was allocated.</p>\n");
    } else {
        page.push_str(
            "<table><thead><tr><th>category</th><th class=\"num\">own peak</th><th class=\"num\">at overall peak</th>\
             <th></th></tr></thead><tbody>\n",
        );
        let at_peak_total = saturating_sum(rows.iter().map(|r| r.2)).max(1);
        for (category, own, at_peak) in rows {
            let share = 100.0 * at_peak as f64 / at_peak_total as f64;
            let _ = writeln!(
                page,
                "<tr><td><i class=\"sw\" style=\"background:{color}\"></i>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
                 <td class=\"bar\"><b style=\"width:{share:.1}%;background:{color}\"></b></td></tr>",
                category.name(),
                format_bytes(own),
                format_bytes(at_peak),
                color = hex(category_color(category)),
            );
        }
        let _ = write!(
            page,
            "<tr class=\"total\"><td>peak allocated</td><td></td><td class=\"num\">{}</td><td></td></tr>\n</tbody></table>\n",
            format_bytes(stats.allocated_bytes.peak)
        );
    }
    let _ = writeln!(
        page,
        "<p class=\"note\">Own peak: the most the category held at any moment. At overall peak: what it held when \
         allocated bytes peaked. {} allocations and {} segments over the run, {} cache retries.</p>",
        stats.allocation.allocated, stats.segment.allocated, stats.num_alloc_retries
    );
    page.push_str("</div>\n</section>\n");
    page.push_str(
        "<footer>Written by memfit-profile. The same recording as a PyTorch memory snapshot opens in \
         <code>python -m torch.cuda._memory_viz</code>; as a Chrome trace in Perfetto.</footer>\n",
    );

    if !chart.hover.is_null() {
        // `</` cannot end the data block early once escaped.
        let data = chart.hover.to_string().replace("</", "<\\/");
        let _ = write!(
            page,
            "<script type=\"application/json\" id=\"chart-data\">{data}</script>\n<script>{SCRIPT}</script>\n"
        );
    }
    page.push_str("</body>\n</html>\n");
    page
}

pub fn write_html(recording: &Recording, path: &Path) -> std::io::Result<()> {
    crate::write_file(path, html(recording))
}

fn card(page: &mut String, label: &str, value: &str, detail: &str, alert: bool) {
    let _ = writeln!(
        page,
        "<div class=\"card{}\"><div class=\"k\">{}</div><div class=\"v\">{}</div><div class=\"d\">{}</div></div>",
        if alert { " alert" } else { "" },
        escape(label),
        escape(value),
        escape(detail)
    );
}

/// A block live at the peak (event `peak`): its category then, and where it came from.
fn live_row(page: &mut String, recording: &Recording, lifetime: &Lifetime, peak: usize, peak_bytes: u64) {
    let at = lifetime.start.map_or("before the recording".to_string(), |i| when(recording, i));
    let _ = writeln!(
        page,
        "<tr><td class=\"num\">{}</td><td class=\"num\">{:.1}%</td><td><i class=\"sw\" style=\"background:{}\"></i>{}</td>\
         <td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td></tr>",
        format_bytes(lifetime.size),
        100.0 * lifetime.size as f64 / peak_bytes as f64,
        hex(category_color(lifetime.category_at(peak))),
        category_cell(lifetime, peak),
        escape(lifetime.op),
        escape(or_dash(recording.module_name(lifetime.module))),
        lifetime.phase.name(),
        escape(&at)
    );
}

/// The category at the peak, and (muted, short enough for the cell; the tooltip says it in full) what
/// a re-tagged block was allocated as, or that its category then is assumed.
fn category_cell(lifetime: &Lifetime, peak: usize) -> String {
    let category = lifetime.category_at(peak);
    match lifetime.note_at(peak) {
        None => category.name().to_string(),
        Some(CategoryNote::AllocatedAs(first)) => format!(
            "<span title=\"allocated as {first}, re-tagged {category} before the peak\">{category} \
             <span class=\"was\">(was {first})</span></span>"
        ),
        Some(CategoryNote::Unknown) => format!(
            "<span title=\"allocated before the recorded events and re-tagged {category} after the peak; \
             its category at the peak is not recorded\">{category}? <span class=\"was\">(not recorded)</span></span>"
        ),
    }
}

/// When event `index` happened, as the chart's axis counts: ms on a computing device, event number on meta.
fn when(recording: &Recording, index: usize) -> String {
    let Some(&(event, time_ns)) = recording.events.get(index) else { return String::new() };
    if recording.device == "meta" {
        format!("event {}", event.seq)
    } else {
        format!("{:.3} ms", time_ns as f64 / 1e6)
    }
}

/// Text for HTML element content and attribute values.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = r#"
*{box-sizing:border-box}
body{margin:0;padding:16px 24px 24px;background:#f4f5f7;color:#1f2328;font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
header h1{margin:0;font-size:21px;font-weight:600}
header .sub{margin:2px 0 12px;color:#656d76}
.cards{display:grid;grid-template-columns:repeat(4,1fr) 1.6fr .8fr;gap:10px;margin-bottom:12px}
.card{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:8px 12px;min-width:0}
.card .k{color:#656d76;font-size:12px;text-transform:uppercase;letter-spacing:.03em}
.card .v{font-size:22px;font-weight:650;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.card .d{color:#656d76;font-size:12px;overflow:hidden;display:-webkit-box;-webkit-line-clamp:2;-webkit-box-orient:vertical}
.card.alert .v{color:#c62828}
.panel{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:10px 14px;margin-bottom:12px;min-width:0}
.legend{display:flex;flex-wrap:wrap;gap:4px 11px;font-size:12.5px;margin:0 0 4px 64px;align-items:center}
.legend i{display:inline-block;width:14px;height:14px;border-radius:3px;margin-right:5px;vertical-align:-2px}
.legend i.line{height:0;border-top:2px solid #222;border-radius:0;vertical-align:4px}
.legend i.line.dash{border-top:2px dashed #c62828}
.legend i.band{border:1px solid #ccc}
.legend .sep{color:#656d76;margin-left:10px}
.chart{position:relative}
.chart svg{display:block;width:100%;height:auto}
.cursor{position:absolute;top:0;width:1px;background:rgba(0,0,0,.45);pointer-events:none}
.tip{position:absolute;pointer-events:none;background:rgba(255,255,255,.96);border:1px solid #d0d7de;border-radius:6px;padding:6px 9px;font-size:12px;box-shadow:0 2px 8px rgba(0,0,0,.12);white-space:nowrap;z-index:2}
.tip b{font-weight:600}
.tip i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:5px}
.columns{display:grid;grid-template-columns:3fr 2fr;gap:12px}
h2{font-size:16px;margin:2px 0 4px}
.note{color:#656d76;margin:2px 0 8px;font-size:13px}
table{border-collapse:collapse;width:100%;font-size:13px}
th{text-align:left;color:#656d76;font-weight:600;border-bottom:1px solid #d8dee4;padding:4px 6px;white-space:nowrap}
td{padding:3px 6px;border-bottom:1px solid #f0f2f4;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:220px}
.num{text-align:right;font-variant-numeric:tabular-nums}
tr.total td{font-weight:600;border-top:1px solid #d8dee4}
i.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
td.bar{width:30%}
td.bar b{display:block;height:10px;border-radius:2px;min-width:1px}
footer{color:#8c959f;font-size:12px;margin-top:4px}
.was{color:#8c959f;font-size:12px}
code{font-size:12px}
"#;

/// The hover read-out: maps the mouse to the chart's x, finds the last drawn event at or before it
/// and shows its numbers. Builds text nodes only (names from the recording are never parsed as HTML).
const SCRIPT: &str = r#"
(function () {
  var d = JSON.parse(document.getElementById('chart-data').textContent);
  var box = document.getElementById('chart'), svg = box.querySelector('svg');
  var tip = document.getElementById('tip'), cursor = document.getElementById('cursor');
  if (!d || !svg || !d.points.length) return;
  function bytes(b) {
    if (b < 1024) return b + ' B';
    var units = ['KiB', 'MiB', 'GiB', 'TiB'], i = 0, s = 1024;
    while (i < 3 && b / s >= 1023.995) { i++; s *= 1024; }
    return (b / s).toFixed(2) + ' ' + units[i];
  }
  function line(parent, text, color, bold) {
    var div = document.createElement('div');
    if (color) { var sw = document.createElement('i'); sw.style.background = color; div.appendChild(sw); }
    var t = document.createElement(bold ? 'b' : 'span'); t.textContent = text; div.appendChild(t);
    parent.appendChild(div);
  }
  function hide() { tip.hidden = true; cursor.hidden = true; }
  box.addEventListener('mouseleave', hide);
  box.addEventListener('mousemove', function (e) {
    var r = svg.getBoundingClientRect(), k = r.width / d.width;
    var px = (e.clientX - r.left) / k;
    if (px < d.plot[0] || px > d.plot[1]) { hide(); return; }
    var x = d.x[0] + (px - d.plot[0]) / (d.plot[1] - d.plot[0]) * (d.x[1] - d.x[0]);
    var lo = 0, hi = d.points.length - 1;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (d.points[mid][0] <= x) lo = mid; else hi = mid - 1; }
    var p = d.points[lo];
    tip.textContent = '';
    line(tip, (d.time ? p[0].toFixed(3) + ' ms' : 'event ' + p[0]) + ' \u00b7 ' + d.phases[p[3]], null, true);
    line(tip, 'allocated ' + bytes(p[1]) + ' \u00b7 reserved ' + bytes(p[2]));
    for (var c = p[5].length - 1; c >= 0; c--) {
      if (p[5][c] > 0) line(tip, d.categories[c] + ' ' + bytes(p[5][c]), d.colors[c]);
    }
    line(tip, d.labels[p[4]]);
    tip.hidden = false; cursor.hidden = false;
    var bx = box.getBoundingClientRect();
    var left = e.clientX - bx.left + 14;
    if (left + tip.offsetWidth > bx.width) left = e.clientX - bx.left - tip.offsetWidth - 14;
    tip.style.left = left + 'px';
    tip.style.top = Math.max(0, e.clientY - bx.top - tip.offsetHeight / 2) + 'px';
    cursor.style.left = (e.clientX - bx.left) + 'px';
    cursor.style.top = (d.plot[2] * k) + 'px';
    cursor.style.height = ((d.plot[3] - d.plot[2]) * k) + 'px';
  });
})();
"#;
