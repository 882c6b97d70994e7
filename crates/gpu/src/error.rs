//! What can go wrong on a GPU, typed, each naming the device or the adapters found.

/// Errors of the GPU backend.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// wgpu found no adapter at all.
    #[error(
        "no GPU adapter found: install a Vulkan, Metal or DX12 driver (the vendor's driver for \
         a GPU, or `apt install mesa-vulkan-drivers libvulkan1` for lavapipe, a CPU Vulkan driver)"
    )]
    NoAdapter,
    /// `gpu:N` with `N` past the adapters found.
    #[error(
        "no GPU adapter {index}: {} found{}\n(a GPU missing from this list needs its Vulkan, \
         Metal or DX12 driver installed)",
        found.len(),
        list(found)
    )]
    AdapterIndex { index: usize, found: Vec<String> },
    /// The adapter refused a device with its own limits.
    #[error("{device}: could not open a device: {reason}")]
    RequestDevice { device: String, reason: String },
    /// The device went away (driver reset, removal, or destroyed).
    #[error("{device}: device lost: {reason}")]
    DeviceLost { device: String, reason: String },
    /// An allocation failed for lack of device memory.
    #[error("{device}: out of device memory allocating {bytes} bytes")]
    OutOfMemory { device: String, bytes: u64 },
    /// A buffer larger than the device allows.
    #[error("{device}: a buffer of {bytes} bytes exceeds the largest buffer, {max} bytes")]
    BufferTooLarge {
        device: String,
        bytes: u64,
        max: u64,
    },
    /// A tensor binding that breaks the device's rules (alignment, binding size, bounds).
    #[error("{device}: cannot bind {what}: {detail}")]
    Binding {
        device: String,
        what: String,
        detail: String,
    },
    /// A launch the kernels do not cover (too many dimensions, a head too wide, a grid too big).
    #[error("{device}: {kernel}: {detail}")]
    Unsupported {
        device: String,
        kernel: &'static str,
        detail: String,
    },
    /// wgpu reported a validation or internal error (a bug on our side, or the driver's).
    #[error("{device}: {detail}")]
    Backend { device: String, detail: String },
    /// Mapping a host-visible buffer (a readback, or a staging buffer for inputs) failed.
    #[error("{device}: mapping a host-visible buffer failed: {detail}")]
    Map { device: String, detail: String },
}

fn list(found: &[String]) -> String {
    if found.is_empty() {
        return String::new();
    }
    let lines: Vec<String> = found
        .iter()
        .enumerate()
        .map(|(i, name)| format!("  gpu:{i}  {name}"))
        .collect();
    format!(":\n{}", lines.join("\n"))
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::GpuError;

    #[test]
    fn a_wrong_index_lists_every_adapter_found() {
        let err = GpuError::AdapterIndex {
            index: 2,
            found: vec![
                "llvmpipe (Vulkan, CPU)".into(),
                "RTX 3060 (Vulkan, discrete GPU)".into(),
            ],
        };
        let msg = err.to_string();
        assert!(msg.starts_with("no GPU adapter 2: 2 found"), "{msg}");
        assert!(
            msg.contains("gpu:0  llvmpipe") && msg.contains("gpu:1  RTX 3060"),
            "{msg}"
        );
        assert!(msg.contains("driver installed"), "{msg}");
    }
}
