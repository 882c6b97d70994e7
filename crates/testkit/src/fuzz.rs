//! What snug's fuzz targets share: the case count (64 in the suite, `PROPTEST_CASES=N` on
//! demand, nothing written into the source tree), a safetensors file's header length, and
//! JSON values of every kind with numbers biased to the edges.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;

/// 64 cases unless `PROPTEST_CASES` says otherwise; a failure prints its minimal input and
/// persists nothing.
pub fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    }
}

/// A runner with [`config`].
pub fn runner() -> TestRunner {
    TestRunner::new(config())
}

/// Bytes of a valid safetensors file's length prefix and JSON header.
pub fn safetensors_header_len(bytes: &[u8]) -> usize {
    let mut prefix = [0u8; 8];
    prefix.copy_from_slice(&bytes[..8]);
    8 + u64::from_le_bytes(prefix) as usize
}

/// A JSON value of any kind, numbers biased to the edges (0, negative, huge, fractional).
pub fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (0u64..70).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop_oneof![
            Just(-1e-5),
            Just(0.0),
            Just(1e-60),
            Just(1e300),
            Just(-1e300),
            any::<f64>()
        ]
        .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[a-z0-9_.]{0,8}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
