//! NumPy broadcasting: the shape rule (the index mapping is the backends').

use super::shape_err;
use crate::Result;

/// The broadcast of two shapes (right-aligned; a dimension of 1 stretches).
pub fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(shape_err(op, format!("cannot broadcast {a:?} with {b:?}")));
            }
        };
    }
    Ok(out)
}

/// Whether `small` broadcasts to `big` (so gradients can be summed back to it).
pub fn broadcasts_to(small: &[usize], big: &[usize]) -> bool {
    small.len() <= big.len()
        && small
            .iter()
            .rev()
            .zip(big.iter().rev())
            .all(|(&s, &b)| s == b || s == 1)
}
