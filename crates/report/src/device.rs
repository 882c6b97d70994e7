//! The table people draw by hand for each card: each component's bytes at the planned peak,
//! its share of the device's memory, and what is left.

use serde::{Deserialize, Serialize};
use snug_plan::Breakdown;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceRow {
    pub component: String,
    pub bytes: usize,
    /// Of the device's memory.
    pub share: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceTable {
    /// What the size is (`--device-memory`, or this machine's available memory).
    pub device: String,
    pub device_bytes: usize,
    /// Components that hold something at the peak, in the breakdown's order.
    pub rows: Vec<DeviceRow>,
    pub peak_bytes: usize,
    /// Device bytes minus the peak; negative when the step does not fit.
    pub left_bytes: i64,
}

impl DeviceTable {
    pub fn new(device: &str, device_bytes: usize, breakdown: &Breakdown) -> DeviceTable {
        let share = |b: usize| {
            if device_bytes == 0 {
                0.0
            } else {
                b as f64 / device_bytes as f64
            }
        };
        let rows = breakdown
            .rows()
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|&(component, bytes)| DeviceRow {
                component: component.to_string(),
                bytes,
                share: share(bytes),
            })
            .collect();
        let peak_bytes = breakdown.total();
        DeviceTable {
            device: device.to_string(),
            device_bytes,
            rows,
            peak_bytes,
            left_bytes: device_bytes as i64 - peak_bytes as i64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_and_what_is_left_add_up() {
        let b = Breakdown {
            parameters: 3 << 30,
            optimizer_state: 6 << 30,
            activations: 1 << 30,
            ..Default::default()
        };
        let t = DeviceTable::new("12GiB", 12 << 30, &b);
        assert_eq!(t.rows.len(), 3);
        assert_eq!(t.rows[0].component, "parameters");
        assert_eq!(t.rows[0].share, 0.25);
        assert_eq!(t.peak_bytes, 10 << 30);
        assert_eq!(t.left_bytes, 2 << 30);
        let small = DeviceTable::new("8GiB", 8 << 30, &b);
        assert_eq!(small.left_bytes, -(2i64 << 30));
    }
}
