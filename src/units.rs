//! Human-friendly sizes (`16M`, `2GiB`, `1048576`), durations (`500ms`, `30s`, `5m`, `1h`) and switches
//! (`on`, `off`) for command lines, `-o` mount options, query strings and config files: one parser of each
//! for every side.

/// Parses a byte size: a number with an optional `K`/`M`/`G`/`T` suffix (binary multiples; `KB`, `KiB`,
/// `MB`, `MiB`... are accepted as the same; a decimal before one, `1.5M`, rounds down to whole bytes) or a
/// plain number of bytes.
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    if num.is_empty() {
        // `-1G` ("an unknown size suffix") or `G`: no number first.
        return Err(UnitError::NotASize(s.to_owned()));
    }
    let mult: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(UnitError::SizeSuffix(s.to_owned())),
    };
    // `1.5M`: a decimal fraction of a unit, whole bytes (rounded down); bytes themselves take none.
    let (whole, fraction) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit());
    if !digits(whole) || (num.contains('.') && (!digits(fraction) || mult == 1)) {
        return Err(UnitError::NotASize(s.to_owned()));
    }
    let too_large = || UnitError::TooLarge(s.to_owned());
    let n: u64 = whole.parse().map_err(|_| too_large())?;
    // Digits past the 18th are below a byte of any unit (2^40 < 10^13).
    let fraction = &fraction[..fraction.len().min(18)];
    let part = match fraction {
        "" => 0,
        f => (u128::from(mult) * f.parse::<u128>().unwrap_or(0) / 10u128.pow(f.len() as u32)) as u64,
    };
    n.checked_mul(mult).and_then(|b| b.checked_add(part)).ok_or_else(too_large)
}

/// Parses a duration: a number with `ms`, `s`, `m` or `h` (a bare number means seconds).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, UnitError> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| UnitError::NotADuration(s.to_owned()))?;
    let secs = match suffix.trim() {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(UnitError::DurationUnit(s.to_owned())),
    };
    std::time::Duration::try_from_secs_f64(secs).map_err(|_| UnitError::OutOfRange(s.to_owned()))
}

/// Parses a duration above zero: an interval or a timeout, which at 0 would spin or expire at once.
pub fn parse_positive_duration(s: &str) -> Result<std::time::Duration, UnitError> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err(UnitError::NotPositive(s.to_owned()));
    }
    Ok(d)
}

/// Parses a number above zero (a rate: at 0 nothing would move).
pub fn parse_positive_number(s: &str) -> Result<f64, UnitError> {
    let n: f64 = s.trim().parse().map_err(|_| UnitError::NotANumber(s.to_owned()))?;
    if !(n > 0.0 && n.is_finite()) {
        return Err(UnitError::NotPositive(s.to_owned()));
    }
    Ok(n)
}

/// Parses a switch: `true`, `on`, `yes`, `1` or `false`, `off`, `no`, `0` (any case, spaces around).
pub fn parse_switch(s: &str) -> Result<bool, UnitError> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "on" | "yes" | "1" => Ok(true),
        "false" | "off" | "no" | "0" => Ok(false),
        _ => Err(UnitError::NotASwitch(s.to_owned())),
    }
}

/// A size, duration or switch that does not parse (the text as given).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("{0:?} is not a size (e.g. 1048576, 64K, 1.5M, 2G)")]
    NotASize(String),
    #[error("{0:?} has an unknown size suffix (use K, M, G or T)")]
    SizeSuffix(String),
    #[error("{0:?} is too large")]
    TooLarge(String),
    #[error("{0:?} is not a duration (e.g. 500ms, 30s, 5m)")]
    NotADuration(String),
    #[error("{0:?} has an unknown duration unit (use ms, s, m or h)")]
    DurationUnit(String),
    #[error("{0:?} is out of range")]
    OutOfRange(String),
    #[error("{0:?} is not a switch (use true or false, on or off)")]
    NotASwitch(String),
    #[error("{0:?} must be more than 0")]
    NotPositive(String),
    #[error("{0:?} is not a number")]
    NotANumber(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_the_same_spellings_everywhere() {
        for on in ["true", "on", "yes", "1", " ON ", "True"] {
            assert_eq!(parse_switch(on), Ok(true), "{on}");
        }
        for off in ["false", "off", "no", "0", "Off"] {
            assert_eq!(parse_switch(off), Ok(false), "{off}");
        }
        for bad in ["", "2", "enabled", "t"] {
            assert_eq!(parse_switch(bad), Err(UnitError::NotASwitch(bad.to_owned())));
        }
    }
    use std::time::Duration;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("1.5M"), Ok(3 << 19));
        assert_eq!(parse_size("0.25G"), Ok(1 << 28));
        assert_eq!(parse_size("0.1K"), Ok(102));
        assert_eq!(parse_size(" 2.M "), Err(UnitError::NotASize(" 2.M ".into())));
        for bad in ["1.5", "1.5B", ".5M", "1..5M", "1.5.1M", "", "M"] {
            assert_eq!(parse_size(bad), Err(UnitError::NotASize(bad.into())), "{bad}");
        }
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
        assert_eq!(parse_size("18446744073709551616"), Err(UnitError::TooLarge("18446744073709551616".into())));
        assert_eq!(parse_size("1.0000000000000000000001K"), Ok(1024));
    }

    /// A negative size said "unknown size suffix"; an interval, a timeout or a rate of 0 spun a CPU, expired
    /// at once or panicked.
    #[test]
    fn negative_sizes_and_zero_intervals_and_rates_are_refused_as_such() {
        assert_eq!(parse_size("-1G"), Err(UnitError::NotASize("-1G".into())));
        assert_eq!(parse_positive_duration("0"), Err(UnitError::NotPositive("0".into())));
        assert_eq!(parse_positive_duration("0ms").unwrap_err().to_string(), "\"0ms\" must be more than 0");
        assert_eq!(parse_positive_duration("1ms"), Ok(Duration::from_millis(1)));
        for bad in ["0", "-3", "nan", "inf"] {
            assert!(parse_positive_number(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_positive_number("0.5"), Ok(0.5));
        assert_eq!(parse_positive_number("x"), Err(UnitError::NotANumber("x".into())));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("60"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("5 parsecs").is_err());
    }
}
