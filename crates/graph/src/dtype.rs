use serde::{Deserialize, Serialize};

/// Element type of a tensor. Planning needs only the byte width; kernels run on `F32` and `I32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    BF16,
    F16,
    /// Token ids and targets.
    I32,
    /// One byte: the codes of a quantized frozen weight (int8, or NF4 two to a byte) or of
    /// block-wise quantized optimizer state (8-bit AdamW).
    U8,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::U8 => "u8",
        }
    }

    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::U8)
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" | "fp32" => Ok(DType::F32),
            "bf16" => Ok(DType::BF16),
            "f16" | "fp16" => Ok(DType::F16),
            "i32" => Ok(DType::I32),
            "u8" => Ok(DType::U8),
            other => Err(format!(
                "unknown dtype `{other}` (expected f32, bf16, f16, i32 or u8)"
            )),
        }
    }
}
