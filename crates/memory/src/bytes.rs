//! Byte counts for people: `format_bytes(3 << 20) == "3.00 MiB"`, `parse_bytes("256MiB") == Ok(268435456)`.
//!
//! `parse_bytes` accepts an integer or decimal number followed by an optional unit, case-insensitive,
//! optional space: B, KiB, MiB, GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of 1000), and K/M/G/T
//! as the binary units. A decimal with a unit is rounded down to a whole byte ("1.1GiB"); a plain byte
//! count must be whole ("1.5" and "1.5B" are errors). Errors are a message naming the input and the
//! accepted forms.
//!
//! `format_bytes` uses B below 1 KiB, else two decimals with KiB/MiB/GiB/TiB.

const KIB: u64 = 1 << 10;

const ACCEPTED: &str = "expected a number with an optional unit such as 512MiB, 2GiB, 1.5GB \
                        (units: B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; K, M, G, T mean KiB..TiB)";

pub fn format_bytes(bytes: u64) -> String {
    if bytes < KIB {
        return format!("{bytes} B");
    }
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut scale = KIB as f64;
    // Move up while the value would print as 1024.00 or more (so 1 MiB - 1 B reads "1.00 MiB").
    while unit + 1 < UNITS.len() && bytes as f64 / scale >= 1023.995 {
        unit += 1;
        scale *= 1024.0;
    }
    format!("{:.2} {}", bytes as f64 / scale, UNITS[unit])
}

pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let invalid = || format!("invalid memory size {text:?}: {ACCEPTED}");
    let trimmed = text.trim();

    // Split into the number (digits and at most one '.') and the unit after optional whitespace.
    let number_end = trimmed.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(number_end);
    let unit = unit.trim_start();
    let (whole, fraction) = match number.split_once('.') {
        Some((whole, fraction)) => (whole, fraction),
        None => (number, ""),
    };
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(invalid());
    }

    // The unit is base^exponent: 1024 = 2^10 per binary step, 1000 = 10^3 per decimal step.
    let (binary, exponent): (bool, u32) = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => (true, 0),
        "k" | "kib" => (true, 10),
        "m" | "mib" => (true, 20),
        "g" | "gib" => (true, 30),
        "t" | "tib" => (true, 40),
        "kb" => (false, 3),
        "mb" => (false, 6),
        "gb" => (false, 9),
        "tb" => (false, 12),
        _ => return Err(invalid()),
    };
    let multiplier: u128 = if binary { 1 << exponent } else { 10u128.pow(exponent) };

    let too_large = || format!("invalid memory size {text:?}: more than {} bytes", u64::MAX);
    let fraction = fraction.trim_end_matches('0');
    if exponent == 0 && !fraction.is_empty() {
        return Err(format!("invalid memory size {text:?}: not a whole number of bytes; {ACCEPTED}"));
    }
    // u64::MAX has 20 digits; any longer whole part is too large whatever the unit.
    let whole = whole.trim_start_matches('0');
    if whole.len() > 20 {
        return Err(too_large());
    }
    let whole: u128 = if whole.is_empty() { 0 } else { whole.parse().map_err(|_| invalid())? };

    // The fraction, rounded down to a whole byte, computed exactly. Digits beyond the `exponent`-th
    // cannot change the result: the kept value F * base^e / 10^len is a multiple of 1/5^e (binary)
    // or an integer (decimal), and the dropped digits add less than that step.
    let fraction = &fraction[..fraction.len().min(exponent as usize)];
    let len = fraction.len() as u32;
    let f: u128 = if fraction.is_empty() { 0 } else { fraction.parse().map_err(|_| invalid())? };
    let fraction_bytes = if binary {
        // F * 2^e / 10^len = F * 2^(e-len) / 5^len, split so nothing overflows u128.
        let five = 5u128.pow(len);
        ((f / five) << (exponent - len)) + ((f % five) << (exponent - len)) / five
    } else {
        f * 10u128.pow(exponent - len)
    };

    u64::try_from(whole * multiplier + fraction_bytes).map_err(|_| too_large())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_the_docs() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1024), "1.00 KiB");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(3 << 20), "3.00 MiB");
        assert_eq!(format_bytes((1 << 20) - 1), "1.00 MiB");
        assert_eq!(format_bytes(5 << 30), "5.00 GiB");
        assert_eq!(format_bytes(2 << 40), "2.00 TiB");
        assert_eq!(format_bytes(u64::MAX), "16777216.00 TiB");
    }

    #[test]
    fn parses_units_and_decimals() {
        assert_eq!(parse_bytes("256MiB"), Ok(268435456));
        assert_eq!(parse_bytes("512"), Ok(512));
        assert_eq!(parse_bytes("512B"), Ok(512));
        assert_eq!(parse_bytes(" 2 GiB "), Ok(2 << 30));
        assert_eq!(parse_bytes("2gib"), Ok(2 << 30));
        assert_eq!(parse_bytes("2G"), Ok(2 << 30));
        assert_eq!(parse_bytes("4k"), Ok(4096));
        assert_eq!(parse_bytes("1T"), Ok(1 << 40));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert_eq!(parse_bytes("0.5MiB"), Ok(512 << 10));
        assert_eq!(parse_bytes(".5KiB"), Ok(512));
        assert_eq!(parse_bytes("3.KB"), Ok(3000));
        assert_eq!(parse_bytes("1.00"), Ok(1), "trailing zeros keep a byte count whole");
        assert_eq!(parse_bytes("0.001KB"), Ok(1));
        assert_eq!(parse_bytes("0.0019KB"), Ok(1));
        assert_eq!(parse_bytes("0.0009765625KiB"), Ok(1), "exactly 1/1024 KiB");
        assert_eq!(parse_bytes("0.0009765624KiB"), Ok(0));
        assert_eq!(parse_bytes("0.333333333333333333333333333333333TiB"), Ok((1u64 << 40) / 3));
        assert_eq!(parse_bytes("1.1GiB"), Ok(1_181_116_006), "rounded down to a whole byte");
        assert_eq!(parse_bytes("10TB"), Ok(10_000_000_000_000));
        assert_eq!(parse_bytes("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_bytes("0000000000000000000000001KiB"), Ok(1024));
    }

    #[test]
    fn every_unit_has_its_own_multiplier() {
        let units = [
            ("B", 1u64),
            ("K", 1 << 10),
            ("KiB", 1 << 10),
            ("M", 1 << 20),
            ("MiB", 1 << 20),
            ("G", 1 << 30),
            ("GiB", 1 << 30),
            ("T", 1 << 40),
            ("TiB", 1 << 40),
            ("KB", 1_000),
            ("MB", 1_000_000),
            ("GB", 1_000_000_000),
            ("TB", 1_000_000_000_000),
        ];
        for (unit, multiplier) in units {
            assert_eq!(parse_bytes(&format!("3{unit}")), Ok(3 * multiplier), "3{unit}");
            assert_eq!(parse_bytes(&format!("3 {}", unit.to_lowercase())), Ok(3 * multiplier), "3 {unit}");
        }
        assert_eq!(parse_bytes("2.5MB"), Ok(2_500_000));
        assert_eq!(parse_bytes("0.25M"), Ok(1 << 18));
        assert_eq!(parse_bytes("1.0000005MB"), Ok(1_000_000), "digits past the unit's precision round down");
    }

    #[test]
    fn a_second_point_is_rejected_even_past_the_unit_s_precision() {
        // The digits after the sixth decimal of MB are dropped; the second '.' must still be seen.
        assert!(parse_bytes("1.1234567.8MB").is_err());
        assert!(parse_bytes("1..5KiB").is_err());
    }

    #[test]
    fn a_whole_part_too_long_for_u128_is_too_large_not_malformed() {
        let forty_digits = format!("1{}TiB", "0".repeat(39));
        assert!(parse_bytes(&forty_digits).unwrap_err().contains("more than"));
        let thirty_digits = format!("1{}TiB", "0".repeat(29));
        assert!(parse_bytes(&thirty_digits).unwrap_err().contains("more than"));
        let twenty_one_digits = format!("1{}", "0".repeat(20));
        assert!(parse_bytes(&twenty_one_digits).unwrap_err().contains("more than"));
    }

    #[test]
    fn rejects_malformed_input_with_a_helpful_message() {
        let err = parse_bytes("12XB").unwrap_err();
        assert!(err.contains("\"12XB\""), "{err}");
        assert!(err.contains("512MiB, 2GiB, 1.5GB"), "{err}");
        for bad in ["", " ", "MiB", ".", "1.2.3", "-5", "+5", "1e9", "1.5", "1.5B", "5 Mi B", "five"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn rejects_values_beyond_u64() {
        assert!(parse_bytes("18446744073709551616").unwrap_err().contains("more than"));
        assert!(parse_bytes("16777216TiB").is_err());
        assert!(parse_bytes("99999999999999999999999999TiB").is_err());
        assert_eq!(parse_bytes("16777215TiB"), Ok(16777215 << 40));
    }
}
