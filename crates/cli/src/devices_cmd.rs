//! `snug devices`: the devices a run can use (`--device cpu|gpu|gpu:N`): this machine's CPU
//! and every GPU adapter wgpu finds, with the limits plans for it assume.

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;
use snug_plan::memory_plan::human_bytes;

#[derive(Args, Debug)]
pub struct DevicesArgs {
    /// Machine-readable output: one JSON object.
    #[arg(long)]
    json: bool,
    /// Memory to show for adapters whose memory cannot be read (e.g. 12GiB), as `fit` and
    /// `train --memory auto` take it.
    #[arg(long, value_name = "SIZE")]
    device_memory: Option<String>,
}

#[derive(Serialize)]
struct CpuDevice {
    /// `--device cpu`.
    device: &'static str,
    /// Physical cores this process may run on (its affinity and CPU quota): the default
    /// `--threads`.
    physical_cores: usize,
    /// Logical CPUs this process may run on.
    logical_cpus: usize,
    /// The vector instructions the kernels run with (`baseline`, `avx2`, `avx512`): the
    /// highest the CPU has, or lower where `SNUG_CPU_ISA` asks.
    isa: &'static str,
    /// Every level this CPU runs, lowest first (what `SNUG_CPU_ISA` may name).
    isa_levels: Vec<&'static str>,
    /// The GEMM's register tile (`avx512`, `avx2`, or `portable`: the gemm crate).
    gemm: &'static str,
    /// How the products of a bf16 run compute on our GEMM tiles: `amx` (AMX tiles:
    /// operands in bf16, sums in f32, attention's heads too), `vdpbf16ps`
    /// (AVX512-BF16: operands in bf16, sums in f32; `SNUG_BF16_MATH=vdpbf16ps` chooses it over
    /// AMX), `model` (the same rounding on the f32 tiles,
    /// `SNUG_BF16_MATH=model`) or `widen` (bf16 widened to f32: no AVX512-BF16, or
    /// `SNUG_BF16_MATH=widen`).
    bf16_products: &'static str,
    /// `bf16_products` is not `widen`: their f32 operands (weights) are rounded to bf16.
    bf16_arithmetic: bool,
}

#[derive(Serialize)]
struct GpuDevice {
    /// `--device gpu:N`.
    device: String,
    /// Whether `--device gpu` picks it (discrete before integrated before virtual GPUs
    /// before CPU drivers).
    default: bool,
    name: String,
    backend: String,
    device_type: String,
    driver: String,
    max_buffer_bytes: u64,
    max_binding_bytes: u64,
    offset_alignment: u32,
    max_storage_buffers_per_stage: u32,
    max_workgroup_size: [u32; 3],
    max_invocations_per_workgroup: u32,
    max_workgroup_memory_bytes: u32,
    max_workgroups_per_dimension: u32,
    subgroup_sizes: [u32; 2],
    shader_f16: bool,
    /// The adapter offers subgroup operations (`SUBGROUP`).
    subgroup: bool,
    /// The kernels' reductions use them: `subgroup`, unless `SNUG_GPU_SUBGROUPS=0` turns them
    /// off.
    subgroups_used: bool,
    /// Device memory where known (a CPU driver's: the system's), else --device-memory's,
    /// else `null`: wgpu reports no other device's memory.
    memory_bytes: Option<u64>,
    /// Where `memory_bytes` comes from: `system memory (a CPU driver)`, `--device-memory`,
    /// or `null`.
    memory_from: Option<&'static str>,
}

#[derive(Serialize)]
struct Devices {
    cpu: CpuDevice,
    gpus: Vec<GpuDevice>,
}

/// What the products of a bf16 run compute here (`SNUG_BF16_MATH` and the CPU's features).
pub(crate) fn bf16_products() -> &'static str {
    snug_cpu::isa::Bf16Math::current().path(snug_cpu::isa::CpuFeatures::host())
}

pub fn run(args: DevicesArgs) -> Result<()> {
    let given = args
        .device_memory
        .as_deref()
        .map(|t| {
            snug_runtime::parse_bytes(t)
                .map(|b| b as u64)
                .with_context(|| format!("--device-memory {t}"))
        })
        .transpose()?;
    let default = snug_gpu::adapter::find(snug_gpu::Selector::FirstGpu)
        .ok()
        .flatten()
        .map(|a| a.index);
    let devices = Devices {
        cpu: CpuDevice {
            device: "cpu",
            physical_cores: snug_cpu::physical_cores(),
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            isa: snug_cpu::isa::current().name(),
            isa_levels: snug_cpu::isa::Isa::ALL
                .into_iter()
                .filter(|&l| l <= snug_cpu::isa::CpuFeatures::host().isa())
                .map(|l| l.name())
                .collect(),
            gemm: snug_graph::CpuGemm::host().name(),
            bf16_products: bf16_products(),
            bf16_arithmetic: bf16_products() != "widen",
        },
        gpus: snug_gpu::adapters_once()
            .iter()
            .map(|a| GpuDevice {
                device: format!("gpu:{}", a.index),
                default: default == Some(a.index),
                name: a.name.clone(),
                backend: a.backend.clone(),
                device_type: a.device_type.clone(),
                driver: a.driver.clone(),
                max_buffer_bytes: a.max_buffer_size,
                max_binding_bytes: a.max_storage_buffer_binding_size,
                offset_alignment: a.min_storage_buffer_offset_alignment,
                max_storage_buffers_per_stage: a.max_storage_buffers_per_shader_stage,
                max_workgroup_size: a.max_compute_workgroup_size,
                max_invocations_per_workgroup: a.max_compute_invocations_per_workgroup,
                max_workgroup_memory_bytes: a.max_compute_workgroup_storage_size,
                max_workgroups_per_dimension: a.max_compute_workgroups_per_dimension,
                subgroup_sizes: a.subgroup_sizes,
                shader_f16: a.shader_f16,
                subgroup: a.subgroup,
                subgroups_used: a.subgroup && snug_gpu::subgroups_allowed(),
                memory_bytes: a.memory_bytes.or(given),
                memory_from: a.memory_source().or(given.map(|_| "--device-memory")),
            })
            .collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&devices)?);
        return Ok(());
    }
    let c = &devices.cpu;
    println!(
        "cpu     the CPUs this process may use: {} physical cores, {} logical CPUs; kernels {}, GEMM tile {}; \
         bf16 products {}",
        c.physical_cores,
        c.logical_cpus,
        c.isa,
        c.gemm,
        match c.bf16_products {
            "amx" => "in bf16 arithmetic (AMX tiles)",
            "vdpbf16ps" => "in bf16 arithmetic (AVX512-BF16)",
            "model" => "rounded to bf16 on the f32 tiles (SNUG_BF16_MATH=model)",
            "widen" if !snug_cpu::isa::CpuFeatures::host().bf16_arithmetic() => {
                "widened to f32 (no AVX512-BF16)"
            }
            _ if snug_cpu::isa::Bf16Math::current() == snug_cpu::isa::Bf16Math::Widen => {
                "widened to f32 (SNUG_BF16_MATH=widen)"
            }
            _ => {
                "widened to f32 (this CPU's VDPBF16PS runs at half its f32 rate; \
                 SNUG_BF16_MATH=vdpbf16ps takes it)"
            }
        }
    );
    if devices.gpus.is_empty() {
        println!(
            "no GPU adapter found: install a Vulkan, Metal or DX12 driver (the vendor's, or \
             `apt install mesa-vulkan-drivers libvulkan1` for Mesa's)"
        );
    }
    let bytes = |b: u64| human_bytes(usize::try_from(b).unwrap_or(usize::MAX));
    for g in &devices.gpus {
        println!(
            "{:<7} {} ({}, {}{}){}",
            g.device,
            g.name,
            g.backend,
            g.device_type,
            if g.driver.is_empty() {
                String::new()
            } else {
                format!(", {}", g.driver)
            },
            if g.default { "  [--device gpu]" } else { "" }
        );
        println!(
            "        memory {}, buffer {}, binding {}, offset alignment {} B, workgroup memory {}, \
             subgroups {}-{}{}{}",
            match (g.memory_bytes, g.memory_from) {
                (Some(m), Some(from)) => format!("{} ({from})", bytes(m)),
                _ => "unknown (give --device-memory SIZE to fit and train)".into(),
            },
            bytes(g.max_buffer_bytes),
            bytes(g.max_binding_bytes),
            g.offset_alignment,
            bytes(u64::from(g.max_workgroup_memory_bytes)),
            g.subgroup_sizes[0],
            g.subgroup_sizes[1],
            if g.shader_f16 { ", f16" } else { "" },
            match (g.subgroup, g.subgroups_used) {
                (true, true) => ", subgroup ops",
                (true, false) => ", subgroup ops (off: SNUG_GPU_SUBGROUPS=0)",
                _ => "",
            }
        );
    }
    Ok(())
}
