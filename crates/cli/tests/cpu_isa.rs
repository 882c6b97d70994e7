//! The portable binary: the kernels choose their vector instructions at run time, and every
//! level this CPU runs (`SNUG_CPU_ISA`) trains the same bits, for GPT and Llama, f32 and bf16,
//! AdamW and 8-bit AdamW. (The GEMM's register tile is chosen apart from the level, so it is
//! the same in every run here.)

use std::process::{Command, Output};

fn snug_env(args: &[&str], isa: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_snug"));
    c.args(args).current_dir(env!("CARGO_TARGET_TMPDIR"));
    c.env_remove("SNUG_CPU_ISA").env_remove("SNUG_BF16_MATH");
    if let Some(isa) = isa {
        c.env("SNUG_CPU_ISA", isa);
    }
    let o = c.output().expect("the snug binary runs");
    assert!(
        o.status.success(),
        "snug {args:?} (SNUG_CPU_ISA={isa:?}): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// `snug args` with `SNUG_BF16_MATH` set to `math`.
fn snug_bf16_math(args: &[&str], math: &str) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_snug"))
        .args(args)
        .current_dir(env!("CARGO_TARGET_TMPDIR"))
        .env("SNUG_BF16_MATH", math)
        .output()
        .expect("the snug binary runs");
    assert!(
        o.status.success(),
        "snug {args:?} (SNUG_BF16_MATH={math}): {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn json(o: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Each step's loss and gradient norm, as the JSON lines print them (shortest round-trip
/// decimals, so equal text is equal bits).
fn steps(o: &Output) -> Vec<String> {
    json(o)
        .iter()
        .filter(|l| l["kind"] == "step")
        .map(|l| format!("{} {} {}", l["step"], l["loss"], l["grad_norm"]))
        .collect()
}

#[test]
fn devices_names_the_level_and_every_level_the_cpu_runs() {
    let v: serde_json::Value =
        serde_json::from_slice(&snug_env(&["devices", "--json"], None).stdout).unwrap();
    let levels: Vec<&str> = v["cpu"]["isa_levels"]
        .as_array()
        .expect("isa_levels")
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert_eq!(levels.first(), Some(&"baseline"));
    // Unasked, the kernels run the highest level.
    assert_eq!(v["cpu"]["isa"].as_str(), levels.last().copied());
    let low: serde_json::Value =
        serde_json::from_slice(&snug_env(&["devices", "--json"], Some("baseline")).stdout).unwrap();
    assert_eq!(low["cpu"]["isa"], "baseline");
    // A level the CPU lacks is lowered to its highest, never run.
    let high: serde_json::Value =
        serde_json::from_slice(&snug_env(&["devices", "--json"], Some("avx512")).stdout).unwrap();
    assert_eq!(high["cpu"]["isa"].as_str(), levels.last().copied());
    assert!(["avx512", "avx2", "portable"].contains(&v["cpu"]["gemm"].as_str().unwrap()));
    // bf16 arithmetic, by default, on AMX's tiles where the kernel reports those (with
    // AVX512-BF16 and AVX-512F), else on `VDPBF16PS` where it reports AVX512-BF16 on a CPU
    // not Intel's (whose VDPBF16PS runs at half its f32 rate).
    let mut has_vdpbf16ps = None;
    if let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") {
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.split(':').next().map(str::trim) == Some(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.split_whitespace().collect::<Vec<_>>())
                .unwrap_or_default()
        };
        let flags = field("flags");
        if cfg!(target_arch = "x86_64") && !flags.is_empty() {
            let has = |f: &str| flags.contains(&f);
            let instructions = has("avx512f") && has("avx512_bf16");
            let intel = field("vendor_id") == ["GenuineIntel"];
            let amx = instructions && has("amx_bf16") && has("amx_tile");
            let want = match (amx, instructions && !intel) {
                (true, _) => "amx",
                (false, true) => "vdpbf16ps",
                (false, false) => "widen",
            };
            assert_eq!(v["cpu"]["bf16_products"].as_str(), Some(want));
            assert_eq!(v["cpu"]["bf16_arithmetic"].as_bool(), Some(want != "widen"));
            has_vdpbf16ps = Some(instructions);
        }
    }
    // `vdpbf16ps` takes VDPBF16PS wherever the CPU has it; with AMX or on Intel's CPUs that
    // is not the default's path.
    let default = v["cpu"]["bf16_products"].as_str().unwrap();
    let vdpbf16ps = match has_vdpbf16ps {
        Some(true) => "vdpbf16ps",
        Some(false) => "widen",
        None if default == "amx" => "vdpbf16ps",
        None => default,
    };
    for (math, want) in [
        ("widen", "widen"),
        ("model", "model"),
        ("native", default),
        ("vdpbf16ps", vdpbf16ps),
    ] {
        let o = snug_bf16_math(&["devices", "--json"], math);
        let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(d["cpu"]["bf16_products"].as_str(), Some(want), "{math}");
    }
}

/// `SNUG_BF16_MATH=model` rounds the f32 operand (a weight) of each bf16 product our tiles
/// run, as bf16 arithmetic does: a bf16 run's losses move, by far less than 1 %, and its plan
/// and measured memory do not. (Where the CPU has no tile of ours, both run the gemm crate.)
#[test]
fn modelled_bf16_arithmetic_moves_the_losses_not_the_plan() {
    let args = [
        "train",
        "--preset",
        "char-small",
        "--precision",
        "bf16",
        "--batch",
        "4",
        "--block",
        "256",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--seed",
        "3",
        "--threads",
        "2",
        "--json",
        "--no-save",
    ];
    let runs = ["widen", "model"].map(|m| json(&snug_bf16_math(&args, m)));
    let of = |run: &[serde_json::Value], key: &str| -> Vec<f64> {
        run.iter()
            .filter(|l| l["kind"] == "step")
            .map(|l| l[key].as_f64().unwrap())
            .collect()
    };
    let [widen, model] = [&runs[0], &runs[1]].map(|r| of(r, "loss"));
    assert_eq!(widen.len(), 2);
    let d: serde_json::Value =
        serde_json::from_slice(&snug_env(&["devices", "--json"], None).stdout).unwrap();
    if d["cpu"]["gemm"] == "portable" {
        assert_eq!(widen, model, "no tile of ours: both widen");
        return;
    }
    assert_ne!(widen, model, "the modelled run rounded nothing");
    for (w, m) in widen.iter().zip(&model) {
        assert!((w - m).abs() <= 0.01 * w.abs(), "loss {m} against {w}");
    }
    assert_eq!(of(&runs[0], "active_bytes"), of(&runs[1], "active_bytes"));
}

#[test]
fn every_level_trains_the_same_bits() {
    let v: serde_json::Value =
        serde_json::from_slice(&snug_env(&["devices", "--json"], None).stdout).unwrap();
    let levels: Vec<String> = v["cpu"]["isa_levels"]
        .as_array()
        .expect("isa_levels")
        .iter()
        .map(|l| l.as_str().unwrap().to_string())
        .collect();
    if levels.len() < 2 {
        eprintln!("only the baseline level on this CPU: nothing to compare");
    }
    let common = [
        "train",
        "--steps",
        "3",
        "--batch",
        "4",
        "--block",
        "32",
        "--threads",
        "2",
        "--eval-every",
        "0",
        "--seed",
        "3",
        "--json",
        "--no-save",
    ];
    let cases: [&[&str]; 4] = [
        &["--preset", "tiny"],
        &["--preset", "tiny", "--precision", "bf16"],
        &["--preset", "llama-tiny"],
        &["--preset", "llama-tiny", "--optimizer", "adamw8bit"],
    ];
    for case in cases {
        let args: Vec<&str> = common.iter().chain(case).copied().collect();
        let want = steps(&snug_env(&args, Some(levels[0].as_str())));
        assert_eq!(want.len(), 3, "{case:?}");
        for level in &levels[1..] {
            let got = steps(&snug_env(&args, Some(level.as_str())));
            assert_eq!(got, want, "{case:?}: {level} against {}", levels[0]);
        }
    }
}
