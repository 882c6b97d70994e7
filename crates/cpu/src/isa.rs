//! Which vector instructions the kernels run with, chosen once at run time from the CPU's
//! features, so one binary built for plain x86-64 (or aarch64) runs at full speed on any CPU.
//!
//! The GEMM's register tiles carry their own `#[target_feature]` and are chosen by
//! [`crate::gemm`]. Everything else (norms, activations, softmax, optimizers, casts) is plain
//! Rust that the compiler vectorises for whatever it is compiled for: [`vectorized`] runs such
//! a body inside a function compiled for the chosen level, where the body is inlined and so
//! vectorised for it. The kernels' arithmetic is the same on every level (no reassociation;
//! [`crate::math`] fuses multiply-adds explicitly), so every level gives the same bits.
//!
//! A closure is a function of its own, compiled for the baseline, and the inliner may leave it
//! uninlined (a large body, another codegen unit): its loops then run at SSE2 under the
//! level's wrapper. So every closure given to [`vectorized`], and every closure the
//! [`crate::par`] helpers call inside it, is written `#[inline(always)] |…|`; a test
//! (`tests/inline_closures.rs`) holds the sources to that. Attention's softmax and AdamW ran
//! at SSE2 until it did (3.4× slower AdamW, 17 % slower attention).

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set level the elementwise kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// What the binary was built for (SSE2 on x86-64, NEON on aarch64).
    Baseline,
    /// AVX2 with FMA (x86-64 since Haswell and Zen).
    Avx2,
    /// AVX-512 F, BW, DQ and VL (Skylake-SP, Ice Lake, Zen 4 and later).
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// Every level, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];
}

/// The x86-64 features the choice depends on: plain data, so the choice is testable for any
/// CPU on any CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512dq: bool,
    pub avx512vl: bool,
    pub avx512bf16: bool,
    /// AMX-TILE and AMX-BF16 that this process may use: the OS granted it tile state and the
    /// tiles passed a check against an f64 product (`gemm::amx::usable`).
    pub amx: bool,
    /// Made by Intel (`GenuineIntel`). Its `VDPBF16PS` retires at a quarter of the rate of its
    /// f32 FMAs, so half their multiply-adds (Emerald Rapids, a 24-accumulator loop over L1:
    /// 1.1 against 4.5 G instructions/s); Zen 4's keeps pace with its FMAs.
    pub intel: bool,
}

impl CpuFeatures {
    /// This machine's.
    pub fn host() -> CpuFeatures {
        #[cfg(target_arch = "x86_64")]
        {
            CpuFeatures {
                avx2: is_x86_feature_detected!("avx2"),
                fma: is_x86_feature_detected!("fma"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512bw: is_x86_feature_detected!("avx512bw"),
                avx512dq: is_x86_feature_detected!("avx512dq"),
                avx512vl: is_x86_feature_detected!("avx512vl"),
                avx512bf16: is_x86_feature_detected!("avx512bf16"),
                amx: crate::gemm::amx::usable(),
                intel: vendor() == *b"GenuineIntel",
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        CpuFeatures::default()
    }

    /// Whether products reading a bf16 operand run in bf16 arithmetic (`VDPBF16PS`, the GEMM's
    /// AVX512-BF16 tile) rather than widened to f32.
    pub fn bf16_arithmetic(self) -> bool {
        // Every CPU with AVX512-BF16 has BW and VL, which its packing uses.
        self.avx512f && self.avx512bw && self.avx512vl && self.avx512bf16
    }

    /// Whether a bf16 run's products take `VDPBF16PS` unasked: where the CPU has it and no AMX
    /// tiles, and it outruns the f32 tiles. On Intel's CPUs it does not (see
    /// [`CpuFeatures::intel`]): a bf16 step there ran 1.7–2.4 times as long on it as with its
    /// operands widened to f32, so without AMX their products widen
    /// (`SNUG_BF16_MATH=vdpbf16ps` still takes it).
    pub fn vdpbf16ps_by_default(self) -> bool {
        self.bf16_arithmetic() && !self.intel
    }

    /// The highest level these features run (each level needs every feature its functions
    /// are compiled with).
    pub fn isa(self) -> Isa {
        let avx2 = self.avx2 && self.fma;
        if avx2 && self.avx512f && self.avx512bw && self.avx512dq && self.avx512vl {
            Isa::Avx512
        } else if avx2 {
            Isa::Avx2
        } else {
            Isa::Baseline
        }
    }
}

/// The CPU's vendor string (CPUID leaf 0: EBX, EDX, ECX).
#[cfg(target_arch = "x86_64")]
fn vendor() -> [u8; 12] {
    // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
    #[allow(unused_unsafe)]
    let r = unsafe { std::arch::x86_64::__cpuid(0) };
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&r.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&r.edx.to_le_bytes());
    v[8..].copy_from_slice(&r.ecx.to_le_bytes());
    v
}

/// Representative feature sets, for tests of the choices made from them.
#[cfg(test)]
impl CpuFeatures {
    /// Haswell, Zen 1–3: AVX2 and FMA.
    pub(crate) const AVX2: CpuFeatures = CpuFeatures {
        avx2: true,
        fma: true,
        avx512f: false,
        avx512bw: false,
        avx512dq: false,
        avx512vl: false,
        avx512bf16: false,
        amx: false,
        intel: false,
    };
    /// Skylake-SP, Ice Lake: AVX-512 F, BW, DQ and VL.
    pub(crate) const AVX512: CpuFeatures = CpuFeatures {
        avx512f: true,
        avx512bw: true,
        avx512dq: true,
        avx512vl: true,
        ..CpuFeatures::AVX2
    };
    /// Zen 4: AVX-512 with AVX512-BF16.
    pub(crate) const AVX512_BF16: CpuFeatures = CpuFeatures {
        avx512bf16: true,
        ..CpuFeatures::AVX512
    };
    /// Cooper Lake, or Sapphire Rapids where the OS grants no AMX tile state: Intel's
    /// AVX512-BF16 without AMX.
    pub(crate) const INTEL_BF16: CpuFeatures = CpuFeatures {
        intel: true,
        ..CpuFeatures::AVX512_BF16
    };
    /// Sapphire Rapids with its AMX tiles granted: AVX512-BF16 and AMX-BF16.
    pub(crate) const AMX: CpuFeatures = CpuFeatures {
        amx: true,
        ..CpuFeatures::INTEL_BF16
    };
}

/// How products that read a bf16 operand compute: `SNUG_BF16_MATH` (`native`, `vdpbf16ps`,
/// `widen` or `model`; anything else, or unset, is `native`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Math {
    /// bf16 arithmetic (operands rounded to bf16, products summed in f32) on AMX's tiles where
    /// the CPU has them, else with `VDPBF16PS` where it has AVX512-BF16; elsewhere bf16 widened
    /// to f32.
    Native,
    /// As `Native`, but `VDPBF16PS` even where AMX's tiles would run: for timing one against
    /// the other on a CPU with both. A process started under any setting but `Native` never
    /// touches the tiles, not even to check them.
    Vdpbf16ps,
    /// Always bf16 widened to f32, never an f32 operand rounded: the same bits on every CPU.
    Widen,
    /// bf16 arithmetic's rounding on the f32 register tiles, on any CPU they run on: each
    /// packed operand value rounded to bf16, the exact products summed in f32. The numbers
    /// `VDPBF16PS` gives, up to the order of the sum (and its flushing of subnormals), for
    /// seeing bf16 arithmetic's effect on a run without the instructions.
    Model,
}

impl Bf16Math {
    pub fn name(self) -> &'static str {
        match self {
            Bf16Math::Native => "native",
            Bf16Math::Vdpbf16ps => "vdpbf16ps",
            Bf16Math::Widen => "widen",
            Bf16Math::Model => "model",
        }
    }

    const ALL: [Bf16Math; 4] = [
        Bf16Math::Native,
        Bf16Math::Vdpbf16ps,
        Bf16Math::Widen,
        Bf16Math::Model,
    ];

    /// The setting in force: [`Bf16Math::set`]'s, else what `SNUG_BF16_MATH` asks for (read
    /// once).
    pub fn current() -> Bf16Math {
        match BF16_MATH.load(Ordering::Relaxed) {
            0 => {
                let asked = std::env::var("SNUG_BF16_MATH").ok();
                let asked = asked.as_deref().map(str::trim);
                let math = Bf16Math::ALL.into_iter().find(|m| asked == Some(m.name()));
                Bf16Math::set(math.unwrap_or(Bf16Math::Native));
                Bf16Math::current()
            }
            n => Bf16Math::ALL[usize::from(n - 1).min(Bf16Math::ALL.len() - 1)],
        }
    }

    /// Computes bf16 products as `self` says from now on, in the whole process (a test that
    /// compares bits with a casting graph's asks for [`Bf16Math::Widen`]).
    pub fn set(self) {
        let at = Bf16Math::ALL.iter().position(|&m| m == self).unwrap_or(0);
        BF16_MATH.store(at as u8 + 1, Ordering::Relaxed);
    }

    /// What a bf16 product computes on a CPU with `cpu`'s features under this setting:
    /// `amx` (AMX tiles), `vdpbf16ps`, `model` (rounded operands on the f32 tiles) or `widen`.
    pub fn path(self, cpu: CpuFeatures) -> &'static str {
        match self {
            Bf16Math::Native if cpu.amx && cpu.bf16_arithmetic() => "amx",
            Bf16Math::Native if cpu.vdpbf16ps_by_default() => "vdpbf16ps",
            Bf16Math::Vdpbf16ps if cpu.bf16_arithmetic() => "vdpbf16ps",
            Bf16Math::Model => "model",
            _ => "widen",
        }
    }
}

/// The index of the [`Bf16Math`] in force plus one (0: not chosen yet).
static BF16_MATH: AtomicU8 = AtomicU8::new(0);

/// The chosen level plus one (0: not chosen yet).
static CHOSEN: AtomicU8 = AtomicU8::new(0);

/// The level the kernels run at: the host's highest, or a lower one that `SNUG_CPU_ISA`
/// (`baseline`, `avx2`, `avx512`) or [`set`] asked for.
pub fn current() -> Isa {
    match CHOSEN.load(Ordering::Relaxed) {
        0 => {
            let asked = std::env::var("SNUG_CPU_ISA").ok();
            let asked = asked.and_then(|s| Isa::ALL.into_iter().find(|i| i.name() == s));
            set(asked.unwrap_or(Isa::Avx512))
        }
        n => Isa::ALL[usize::from(n - 1).min(Isa::ALL.len() - 1)],
    }
}

/// Runs the kernels at `isa` (at most the host's level, which is what it returns) from now
/// on, in the whole process: for comparing levels, and for `SNUG_CPU_ISA`.
pub fn set(isa: Isa) -> Isa {
    let isa = isa.min(CpuFeatures::host().isa());
    CHOSEN.store(isa as u8 + 1, Ordering::Relaxed);
    isa
}

/// Runs `body` compiled for the current level: inlined into a function with that level's
/// `#[target_feature]`, so its loops vectorise for it. `body` must be an
/// `#[inline(always)]` closure (see the module's notes).
#[inline(always)]
pub fn vectorized<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    match current() {
        // SAFETY: `current` never returns a level the host lacks.
        Isa::Avx512 => unsafe { x86::avx512(body) },
        Isa::Avx2 => unsafe { x86::avx2(body) },
        Isa::Baseline => body(),
    }
    #[cfg(not(target_arch = "x86_64"))]
    body()
}

/// A hot loop whose body must be compiled for the current level whatever the inliner makes
/// of a closure (one generic over element types can land in another codegen unit than
/// [`vectorized`]'s wrapper, and stay at the baseline): `run` is `#[inline(always)]` in its
/// impls, so [`vectorized_loop`] compiles it inside each level's function.
pub(crate) trait Loop {
    fn run(self);
}

/// Runs `body` compiled for the current level, as [`vectorized`] does, certainly.
#[inline(always)]
pub(crate) fn vectorized_loop(body: impl Loop) {
    #[cfg(target_arch = "x86_64")]
    match current() {
        // SAFETY: `current` never returns a level the host lacks.
        Isa::Avx512 => unsafe { x86::avx512_loop(body) },
        Isa::Avx2 => unsafe { x86::avx2_loop(body) },
        Isa::Baseline => body.run(),
    }
    #[cfg(not(target_arch = "x86_64"))]
    body.run()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2_loop(body: impl super::Loop) {
        body.run()
    }

    /// # Safety
    /// The CPU must have AVX-512 F, BW, DQ and VL, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
    pub(super) unsafe fn avx512_loop(body: impl super::Loop) {
        body.run()
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn avx2<R>(body: impl FnOnce() -> R) -> R {
        body()
    }

    /// # Safety
    /// The CPU must have AVX-512 F, BW, DQ and VL, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
    pub(super) unsafe fn avx512<R>(body: impl FnOnce() -> R) -> R {
        body()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_is_the_highest_whose_every_feature_is_there() {
        let none = CpuFeatures::default();
        assert_eq!(none.isa(), Isa::Baseline);
        let (avx2, avx512) = (CpuFeatures::AVX2, CpuFeatures::AVX512);
        assert_eq!(avx2.isa(), Isa::Avx2);
        // AVX2 without FMA (some early VIA and Intel Atom-class parts) stays at the baseline.
        assert_eq!(CpuFeatures { fma: false, ..avx2 }.isa(), Isa::Baseline);
        assert_eq!(avx512.isa(), Isa::Avx512);
        // Knights Landing: AVX-512F without BW/VL.
        let knl = CpuFeatures {
            avx512bw: false,
            avx512vl: false,
            ..avx512
        };
        assert_eq!(knl.isa(), Isa::Avx2);
        assert_eq!(CpuFeatures::AVX512_BF16.isa(), Isa::Avx512);
    }

    /// The path `snug devices` reports for each setting on each feature set: AMX's tiles only
    /// under `native` on a CPU with them; `VDPBF16PS` under `native` where AVX512-BF16 is, AMX
    /// is not and the CPU is not Intel's, and under `vdpbf16ps` wherever AVX512-BF16 is;
    /// widening elsewhere.
    #[test]
    fn bf16_products_take_the_path_the_setting_and_the_features_allow() {
        let (avx512, bf16, intel, amx) = (
            CpuFeatures::AVX512,
            CpuFeatures::AVX512_BF16,
            CpuFeatures::INTEL_BF16,
            CpuFeatures::AMX,
        );
        let cases = [
            (Bf16Math::Native, amx, "amx"),
            (Bf16Math::Native, bf16, "vdpbf16ps"),
            (Bf16Math::Native, intel, "widen"),
            (Bf16Math::Native, avx512, "widen"),
            (Bf16Math::Vdpbf16ps, amx, "vdpbf16ps"),
            (Bf16Math::Vdpbf16ps, bf16, "vdpbf16ps"),
            (Bf16Math::Vdpbf16ps, intel, "vdpbf16ps"),
            (Bf16Math::Vdpbf16ps, avx512, "widen"),
            (Bf16Math::Widen, amx, "widen"),
            (Bf16Math::Model, amx, "model"),
            (Bf16Math::Model, avx512, "model"),
        ];
        for (math, cpu, want) in cases {
            assert_eq!(math.path(cpu), want, "{math:?} on {cpu:?}");
        }
    }
}
