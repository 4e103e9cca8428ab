//! Fuzzing the byte-size parser (`--memory`, issue 12): any string gets a size or a message that
//! quotes it; a size it accepts formats back to a string it parses to the same size within the
//! rounding of two decimals; no input panics. `MEMFIT_FUZZ_CASES=N` runs N cases (default 256).

use memfit_memory::{format_bytes, parse_bytes};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// `MEMFIT_FUZZ_CASES` cases (default 256) from seed `MEMFIT_FUZZ_SEED` (default fixed, so a
/// CI run is reproducible; give another seed, or many cases, to explore).
fn config() -> Config {
    let env = |key: &str| std::env::var(key).ok().and_then(|v| v.parse::<u64>().ok());
    let cases = env("MEMFIT_FUZZ_CASES").map_or(256, |n| n.min(u32::MAX as u64) as u32);
    Config { cases, rng_seed: RngSeed::Fixed(env("MEMFIT_FUZZ_SEED").unwrap_or(0x5eed)), ..Config::default() }
}

/// Strings near the grammar: a number (maybe odd), spaces, a unit (maybe mangled).
fn size_like() -> impl Strategy<Value = String> {
    let number = prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        "[0-9]{0,30}(\\.[0-9]{0,30})?",
        Just("nan".to_string()),
        Just("-1".to_string()),
        Just("1e400".to_string()),
    ];
    let unit = prop_oneof![
        Just(""),
        Just("B"),
        Just("KB"),
        Just("KiB"),
        Just("MB"),
        Just("MiB"),
        Just("GB"),
        Just("GiB"),
        Just("TB"),
        Just("TiB"),
        Just("PiB"),
        Just("k"),
        Just("M"),
        Just("G"),
        Just("iB"),
        Just("MiBB"),
        Just("\u{b5}B"),
    ];
    (number, " {0,2}", unit, " {0,2}").prop_map(|(n, s, u, t)| format!("{n}{s}{u}{t}"))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_string_gets_a_size_or_a_message_quoting_it(text in prop_oneof![size_like(), any::<String>()]) {
        match parse_bytes(&text) {
            Ok(bytes) => {
                let again = parse_bytes(&format_bytes(bytes)).expect("a formatted size parses");
                let tolerance = (bytes as f64 * 0.01).max(1.0);
                prop_assert!((again as f64 - bytes as f64).abs() <= tolerance, "{} -> {} -> {}", text, bytes, again);
            }
            Err(message) => prop_assert!(message.contains(&format!("{text:?}")), "{}", message),
        }
    }
}
