//! Reading safetensors files with errors that name the tensor at fault. The `safetensors`
//! crate's own errors ("invalid shape, data type, or offset", "metadata incomplete buffer") do
//! not say which tensor is wrong; when it refuses a file, the header is read again here, tensor
//! by tensor, to say which and why.

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

/// Bytes of the little-endian header length that starts every safetensors file.
const LEN_BYTES: usize = 8;

/// Parses `bytes` as a safetensors file (no tensor is copied). The error says what is wrong,
/// naming the tensor when one is at fault.
pub fn deserialize(bytes: &[u8]) -> Result<SafeTensors<'_>, String> {
    SafeTensors::deserialize(bytes).map_err(|e| explain(bytes).unwrap_or_else(|| e.to_string()))
}

/// One header entry, as declared.
struct Entry<'a> {
    name: &'a str,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// Why the header of `bytes` is refused, naming the tensor at fault; `None` when no tensor is
/// (the header itself is unreadable), and the crate's own message is the best there is.
fn explain(bytes: &[u8]) -> Option<String> {
    let len: [u8; LEN_BYTES] = bytes.get(..LEN_BYTES)?.try_into().ok()?;
    let n = usize::try_from(u64::from_le_bytes(len)).ok()?;
    let header = bytes.get(LEN_BYTES..LEN_BYTES.checked_add(n)?)?;
    let data_len = bytes.len() - LEN_BYTES - n;
    let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(header) else {
        return None;
    };
    let mut entries = Vec::with_capacity(map.len());
    for (name, info) in &map {
        if name == "__metadata__" {
            continue;
        }
        match entry(name, info) {
            Ok(e) => entries.push(e),
            Err(why) => return Some(format!("tensor `{name}`: {why}")),
        }
    }
    // The data section holds the tensors back to back, in offset order (the crate's order).
    entries.sort_by_key(|e| (e.start, e.end));
    let mut next = 0usize;
    for e in &entries {
        let bad = |why: String| Some(format!("tensor `{}`: {why}", e.name));
        let offsets = format!("data_offsets [{}, {}]", e.start, e.end);
        if e.end < e.start {
            return bad(format!("{offsets} end before they start"));
        }
        if e.start > next {
            return bad(format!(
                "{offsets} leave bytes {next}..{} of the data section unused",
                e.start
            ));
        }
        if e.start < next {
            return bad(format!(
                "{offsets} overlap the previous tensor's data, which ends at {next}"
            ));
        }
        let Some(bits) = e
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|n| n.checked_mul(e.dtype.bitsize()))
        else {
            return bad(format!(
                "shape {:?} of {:?} overflows a 64-bit byte count",
                e.shape, e.dtype
            ));
        };
        if bits % 8 != 0 {
            return bad(format!(
                "shape {:?} of {:?} is not a whole number of bytes",
                e.shape, e.dtype
            ));
        }
        if e.end - e.start != bits / 8 {
            return bad(format!(
                "shape {:?} of {:?} is {} bytes, but its {offsets} span {}",
                e.shape,
                e.dtype,
                bits / 8,
                e.end - e.start
            ));
        }
        if e.end > data_len {
            return bad(format!(
                "{offsets} run past the end of the file's {data_len} data bytes (truncated?)"
            ));
        }
        next = e.end;
    }
    if next != data_len {
        return Some(format!(
            "{} bytes follow the last tensor's data (the header declares {next} of {data_len})",
            data_len - next
        ));
    }
    None
}

/// The declared dtype, shape and offsets of one tensor, or why they are malformed.
fn entry<'a>(name: &'a str, info: &Value) -> Result<Entry<'a>, String> {
    let obj = info
        .as_object()
        .ok_or_else(|| format!("expected an object, found {info}"))?;
    let field = |key: &str| obj.get(key).ok_or_else(|| format!("`{key}` is missing"));
    let dtype_value = field("dtype")?;
    let dtype: Dtype = serde_json::from_value(dtype_value.clone())
        .map_err(|_| format!("dtype {dtype_value} is not a safetensors dtype"))?;
    let sizes = |key: &str| -> Result<Vec<usize>, String> {
        let v = field(key)?;
        v.as_array()
            .and_then(|a| {
                a.iter()
                    .map(|x| x.as_u64().and_then(|n| usize::try_from(n).ok()))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| format!("`{key}` is {v}, expected a list of non-negative integers"))
    };
    let shape = sizes("shape")?;
    let offsets = sizes("data_offsets")?;
    let [start, end] = offsets[..] else {
        return Err(format!(
            "`data_offsets` has {} numbers, expected 2 (start, end)",
            offsets.len()
        ));
    };
    Ok(Entry {
        name,
        dtype,
        shape,
        start,
        end,
    })
}

/// The first value of `values` that is NaN or infinite, with its index.
pub fn first_non_finite(values: &[f32]) -> Option<(usize, f32)> {
    values
        .iter()
        .position(|v| !v.is_finite())
        .map(|i| (i, values[i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file with the given raw header JSON and `data_len` data bytes.
    fn file(header: &str, data_len: usize) -> Vec<u8> {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(0u8, data_len));
        bytes
    }

    fn error(header: &str, data_len: usize) -> String {
        match deserialize(&file(header, data_len)) {
            Ok(_) => panic!("{header} loaded"),
            Err(e) => e,
        }
    }

    #[test]
    fn refused_headers_name_the_tensor_and_the_reason() {
        let a = r#""a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}"#;
        // A good file loads.
        assert!(deserialize(&file(&format!("{{{a}}}"), 8)).is_ok());
        let cases = [
            (
                r#""b": {"dtype": "F32", "shape": [3], "data_offsets": [8, 16]}"#,
                16,
                "tensor `b`: shape [3] of F32 is 12 bytes, but its data_offsets [8, 16] span 8",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}"#,
                20,
                "tensor `b`: data_offsets [12, 20] leave bytes 8..12",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}"#,
                12,
                "tensor `b`: data_offsets [4, 12] overlap",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}"#,
                12,
                "tensor `b`: data_offsets [8, 16] run past the end of the file's 12 data bytes",
            ),
            (
                r#""b": {"dtype": "F99", "shape": [2], "data_offsets": [8, 16]}"#,
                16,
                "tensor `b`: dtype \"F99\" is not a safetensors dtype",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [-2], "data_offsets": [8, 16]}"#,
                16,
                "tensor `b`: `shape` is [-2]",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [2]}"#,
                16,
                "tensor `b`: `data_offsets` is missing",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [8, 16]}"#,
                16,
                "tensor `b`: shape [4294967296, 4294967296] of F32 overflows",
            ),
            (
                r#""b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}"#,
                20,
                "4 bytes follow the last tensor's data",
            ),
        ];
        for (b, data_len, want) in cases {
            let err = error(&format!("{{{a}, {b}}}"), data_len);
            assert!(err.contains(want), "{b}: {err}");
        }
        // No tensor to blame: the crate's message.
        assert!(error("not json", 0).contains("JSON"));
        assert!(deserialize(b"abc").is_err());
    }

    #[test]
    fn finds_the_first_non_finite_value() {
        assert_eq!(first_non_finite(&[1.0, 2.0]), None);
        assert_eq!(
            first_non_finite(&[1.0, f32::INFINITY, f32::NAN]),
            Some((1, f32::INFINITY))
        );
        assert!(first_non_finite(&[0.0, 0.0, f32::NAN]).is_some_and(|(i, v)| i == 2 && v.is_nan()));
    }
}
