//! Start-up agreement between the ranks of a run: every rank must train the same model on the
//! same data with the same settings, or their averaged gradients mean nothing. Each rank
//! hashes each configuration key, its plan and its data; the hashes are all-gathered, and any
//! rank that differs from rank 0 stops every rank with the keys named.

use snug_cpu::kernels::collective::installed;
use snug_plan::MemoryPlan;

use crate::{TokenDataset, TrainConfig, TrainError};

/// Keys a rank may set for itself: where rank 0 saves (the others save nothing) and how many
/// threads its machine runs.
const PER_RANK_KEYS: [&str; 2] = ["out", "threads"];

/// The named parts a rank's run is hashed in, in a fixed order.
fn parts(
    config: &TrainConfig,
    plan: &MemoryPlan,
    data: &TokenDataset,
) -> Result<Vec<(String, u32)>, TrainError> {
    let value = serde_json::to_value(config).map_err(|e| TrainError::Config {
        field: "devices",
        detail: format!("the configuration could not be hashed for the ranks to compare: {e}"),
    })?;
    let mut out: Vec<(String, u32)> = match value {
        serde_json::Value::Object(map) => map
            .into_iter()
            .filter(|(k, _)| !PER_RANK_KEYS.contains(&k.as_str()))
            .map(|(k, v)| {
                let h = crc32fast::hash(v.to_string().as_bytes());
                (k, h)
            })
            .collect(),
        _ => Vec::new(),
    };
    out.sort();
    let plan_text = format!(
        "{} {} {} {}",
        plan.peak_bytes(),
        plan.persistent_bytes,
        plan.arena_bytes,
        plan.schedule.len()
    );
    out.push(("plan".into(), crc32fast::hash(plan_text.as_bytes())));
    out.push(("data".into(), data_hash(data)));
    Ok(out)
}

/// The tokenizer, the splits' lengths and 64 windows of each split.
fn data_hash(data: &TokenDataset) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(
        serde_json::to_string(&data.tokenizer.to_spec())
            .unwrap_or_default()
            .as_bytes(),
    );
    let mut window = [0i32; 16];
    for split in [&data.train, &data.val] {
        let len = split.len();
        h.update(&(len as u64).to_le_bytes());
        if len < window.len() {
            continue;
        }
        for i in 0..64 {
            split.window((len - window.len()) * i / 63, &mut window);
            window.iter().for_each(|t| h.update(&t.to_le_bytes()));
        }
    }
    h.finalize()
}

/// Refuses a run whose ranks were started differently; nothing in a world of one. Every rank
/// calls it at the same point of its start-up.
pub(crate) fn check_agreement(
    config: &TrainConfig,
    plan: &MemoryPlan,
    data: &TokenDataset,
) -> Result<(), TrainError> {
    let Some(t) = installed() else {
        return Ok(());
    };
    let parts = parts(config, plan, data)?;
    // Two 16-bit halves per hash: f32 holds them exactly.
    let mine: Vec<f32> = parts
        .iter()
        .flat_map(|&(_, h)| [(h >> 16) as f32, (h & 0xffff) as f32])
        .collect();
    let mut all = vec![0.0; mine.len() * t.size()];
    t.all_gather(&mine, &mut all);
    let rank0 = &all[..mine.len()];
    let mut differing: Vec<(usize, Vec<&str>)> = Vec::new();
    for (rank, theirs) in all.chunks_exact(mine.len()).enumerate().skip(1) {
        let keys: Vec<&str> = parts
            .iter()
            .enumerate()
            .filter(|(i, _)| theirs[2 * i..2 * i + 2] != rank0[2 * i..2 * i + 2])
            .map(|(_, (k, _))| k.as_str())
            .collect();
        if !keys.is_empty() {
            differing.push((rank, keys));
        }
    }
    if differing.is_empty() {
        return Ok(());
    }
    Err(TrainError::RanksDisagree {
        detail: differing
            .iter()
            .map(|(rank, keys)| format!("rank {rank} differs from rank 0 in {}", keys.join(", ")))
            .collect::<Vec<_>>()
            .join("; "),
    })
}
