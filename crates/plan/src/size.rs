//! Byte sizes as people write them: `1.5GiB`, `800MB`, `4096`.

/// A size string that is not a byte count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{input}` is not a byte size: {reason} (examples: 4096, 800MB, 1.5GiB)")]
pub struct SizeError {
    pub input: String,
    pub reason: &'static str,
}

/// Parses a byte size; decimal units (KB, MB, GB, TB, PB, EB) are powers of 1000, binary units
/// (KiB, MiB, GiB, TiB, PiB, EiB, as snug prints sizes) powers of 1024; a bare number is whole
/// bytes. Case-insensitive.
pub fn parse_bytes(input: &str) -> Result<usize, SizeError> {
    let err = |reason| SizeError {
        input: input.to_string(),
        reason,
    };
    let s = input.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    if s.starts_with('-') {
        return Err(err("a size is not negative"));
    }
    if number.is_empty() {
        return Err(err("no number"));
    }
    let value: f64 = number.parse().map_err(|_| err("malformed number"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" | "k" => 1e3,
        "mb" | "m" => 1e6,
        "gb" | "g" => 1e9,
        "tb" | "t" => 1e12,
        // No bare `e`: `5e` would read as a mistyped exponent.
        "pb" => 1e15,
        "eb" => 1e18,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "pib" => 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
        "eib" => 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return Err(err("unknown unit")),
    };
    if scale == 1.0 && value.fract() != 0.0 {
        return Err(err("a fraction of a byte"));
    }
    let bytes = (value * scale).round();
    if !bytes.is_finite() || bytes >= usize::MAX as f64 {
        return Err(err("too large"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_negative_size_is_named_as_such() {
        let e = parse_bytes("-1GiB").unwrap_err();
        assert_eq!(e.reason, "a size is not negative");
        assert!(e.to_string().contains("`-1GiB`"), "{e}");
    }

    #[test]
    fn parses_decimal_and_binary_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("800MB"), Ok(800_000_000));
        assert_eq!(parse_bytes("1.5GiB"), Ok(1_610_612_736));
        assert_eq!(parse_bytes(" 2 kib "), Ok(2048));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("2PiB"), Ok(1 << 51));
        assert_eq!(parse_bytes("1EiB"), Ok(1 << 60));
        assert_eq!(parse_bytes("3PB"), Ok(3_000_000_000_000_000));
        assert_eq!(parse_bytes("1.5KB"), Ok(1500));
    }

    #[test]
    fn rejects_what_is_not_a_size() {
        for bad in [
            "",
            "GiB",
            "-1GB",
            "1.2.3MB",
            "12 parsecs",
            "1e400",
            "99999999999999999999TiB",
            "16EiB",
            "0.5",
            "10.5B",
            "5e",
            "1e9",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad}");
        }
    }
}
