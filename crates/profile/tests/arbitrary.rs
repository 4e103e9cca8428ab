//! No input makes an output panic: arbitrary recordings (events in any order and of any kind, frees
//! and re-tags of unknown addresses, times going backwards, dropped counts without a matching snapshot,
//! module ids beyond the table, inverted spans) still give a pickle that decodes, JSON that parses, a
//! whole page and a summary.

use memfit_memory::{BlockSnapshot, Category, Event, EventKind, MemoryStats, Phase, Request, SegmentSnapshot, Stat};
use memfit_profile::{
    chrome_trace, curves_svg, html, snapshot_pickle, summary, summary_json, CurvePoint, Curves, Recording, Span,
    SpanKind,
};
use proptest::prelude::*;

const OPS: [&str; 4] = ["matmul", "conv2d", "", "a<b>&\"c\""];
const KINDS: [EventKind; 6] = [
    EventKind::Alloc,
    EventKind::Free,
    EventKind::SegmentAlloc,
    EventKind::SegmentFree,
    EventKind::Oom,
    EventKind::Retag,
];
const PHASES: [Phase; 7] =
    [Phase::Setup, Phase::Data, Phase::Forward, Phase::Backward, Phase::Optimizer, Phase::Eval, Phase::Rehearsal];

fn event() -> impl Strategy<Value = (Event, u64)> {
    (
        0..KINDS.len(),
        0..8u64,
        prop_oneof![Just(0u64), 1..u64::MAX / 4, Just(u64::MAX)],
        0..7usize,
        0..4usize,
        0..6usize,
        0..9u32,
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(kind, address, bytes, category, op, phase, module, allocated, reserved, time)| {
            let event = Event {
                seq: time % 1000,
                kind: KINDS[kind],
                bytes,
                address: address << 9,
                category: Category::ALL[category],
                op: OPS[op],
                phase: PHASES[phase],
                module,
                allocated: allocated % (1 << 40),
                reserved: reserved % (1 << 41),
            };
            // Mostly plausible times; sometimes near the end of the clock, close together.
            let time = if time % 5 == 0 { u64::MAX - time % 100_000 } else { time % 1_000_000_000 };
            (event, time)
        })
}

fn recording() -> impl Strategy<Value = Recording> {
    (
        prop::collection::vec(event(), 0..300),
        0..3u64,
        prop::collection::vec((0..8u64, prop::collection::vec((1..4u64, any::<bool>(), 0..7usize), 0..5)), 0..4),
        prop::collection::vec("[a-z.<>&0-9]{0,12}", 0..5),
        prop::collection::vec((any::<u64>(), any::<u64>(), 0..9u32, any::<bool>()), 0..20),
        prop::option::of(any::<u64>()),
        any::<u64>(),
    )
        .prop_map(|(events, dropped, segments, modules, spans, capacity, peak)| {
            let segments = segments
                .into_iter()
                .map(|(base, blocks)| {
                    let address = base << 21;
                    let mut cursor = address;
                    let blocks: Vec<BlockSnapshot> = blocks
                        .into_iter()
                        .map(|(units, allocated, category)| {
                            let block = BlockSnapshot {
                                address: cursor,
                                size: units << 9,
                                requested: units << 8,
                                allocated,
                                owner: Request {
                                    category: Category::ALL[category],
                                    op: "op",
                                    phase: Phase::Forward,
                                    module: 1,
                                },
                            };
                            cursor += units << 9;
                            block
                        })
                        .collect();
                    SegmentSnapshot { address, total_size: cursor - address, pool: "small", expandable: false, blocks }
                })
                .collect();
            let spans = spans
                .into_iter()
                .map(|(start_ns, end_ns, module, op)| Span {
                    name: "span".to_string(),
                    kind: if op { SpanKind::Op } else { SpanKind::Module },
                    phase: Phase::Backward,
                    module,
                    start_ns,
                    end_ns,
                })
                .collect();
            let stat = Stat { current: peak / 3, peak, allocated: peak, freed: 0 };
            Recording {
                title: "t<i>tle".to_string(),
                device: if dropped == 1 { "meta".to_string() } else { "cpu".to_string() },
                ordinal: 0,
                capacity,
                events,
                dropped_events: dropped * 1000,
                segments,
                modules,
                spans,
                stats: MemoryStats { allocated_bytes: stat, reserved_bytes: stat, ..MemoryStats::default() },
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_recording_gives_every_output(recording in recording()) {
        let pickle = snapshot_pickle(&recording);
        prop_assert!(serde_pickle::value_from_slice(&pickle, serde_pickle::DeOptions::new()).is_ok());
        let page = html(&recording);
        prop_assert!(page.trim_end().ends_with("</html>"));
        prop_assert!(!page.contains("<i>tle"), "the title is escaped");
        prop_assert!(serde_json::from_str::<serde_json::Value>(&chrome_trace(&recording)).is_ok());
        prop_assert!(!summary(&recording).is_empty());
        prop_assert!(summary_json(&recording).is_object());
    }

    #[test]
    fn any_curve_gives_an_svg(points in prop::collection::vec(
        (0..1000usize, prop::option::of(any::<f64>()), prop::option::of(any::<f64>()), any::<u64>(), any::<u64>(), any::<u64>()), 0..50),
        capacity in prop::option::of(any::<u64>())) {
        let points: Vec<CurvePoint> = points
            .into_iter()
            .map(|(step, train_loss, val_loss, allocated, peak_allocated, reserved)| CurvePoint { step, train_loss, val_loss, allocated, peak_allocated, reserved })
            .collect();
        let svg = curves_svg(&Curves { capacity, ..Curves::of_points(points) });
        prop_assert!(svg.contains("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
