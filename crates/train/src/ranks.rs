//! Start-up agreement between the ranks of a run: every rank must train the same model on the
//! same data with the same settings, or their averaged gradients mean nothing. Each rank
//! hashes each configuration key, its plan and its data; the hashes are all-gathered, and any
//! rank that differs from rank 0 stops every rank with the keys named.

use snug_cpu::kernels::collective::installed;
use snug_plan::MemoryPlan;
use snug_runtime::{Device, OutOfMemory};

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

/// 16-bit words of a byte count, each exact in f32 (the transport moves f32).
fn words(n: usize) -> [f32; 4] {
    let n = n as u64;
    [0, 1, 2, 3].map(|i| ((n >> (16 * i)) & 0xffff) as f32)
}

fn from_words(w: &[f32]) -> usize {
    let n = w
        .iter()
        .enumerate()
        .fold(0u64, |n, (i, &x)| n | ((x as u64) << (16 * i)));
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Whether any rank ran out of memory taking its arena for a micro-batch (`mine`: this rank's
/// failure): the failure of the lowest such rank, and that rank, so that every rank recovers
/// from the same failure to the same configuration. Every rank calls it at the same point of
/// each micro-batch, before the step's first collective; in a world of one it is `mine`.
pub(crate) fn first_out_of_memory(mine: Option<&OutOfMemory>) -> Option<(usize, OutOfMemory)> {
    let Some(t) = installed() else {
        return mine.map(|oom| (0, oom.clone()));
    };
    let mut status = vec![0.0f32; 17];
    if let Some(oom) = mine {
        status[0] = 1.0;
        for (i, n) in [oom.requested, oom.limit, oom.active, oom.cached]
            .into_iter()
            .enumerate()
        {
            status[1 + 4 * i..5 + 4 * i].copy_from_slice(&words(n));
        }
    }
    let mut all = vec![0.0; status.len() * t.size()];
    t.all_gather(&status, &mut all);
    let (rank, s) = all
        .chunks_exact(status.len())
        .enumerate()
        .find(|(_, s)| s[0] == 1.0)?;
    let field = |i: usize| from_words(&s[1 + 4 * i..5 + 4 * i]);
    Some((
        rank,
        OutOfMemory {
            requested: field(0),
            limit: field(1),
            active: field(2),
            cached: field(3),
            device: mine.map_or(Device::Cpu, |oom| oom.device),
        },
    ))
}

/// The memory budget every rank plans for when each was given its available memory
/// (`--memory auto`), `mine` being this rank's budget: ranks that share memory divide it, and
/// all take the smallest part any rank has, so that they plan alike. `mine` itself in a world
/// of one. On the host (`host_memory`), the ranks on one machine (one kernel: containers
/// included) share its memory, and those under one control-group limit, where that limit
/// bounds them (a container's, a Slurm job's), share its room.
pub fn shared_auto_budget(mine: usize, host_memory: bool) -> usize {
    let Some(t) = installed().filter(|t| t.size() > 1) else {
        return mine;
    };
    use snug_runtime::process;
    let machine = process::machine_id();
    let available = process::machine_available();
    let (group, machine_budget) = if host_memory {
        let group = process::cgroup_room()
            .filter(|g| available.is_none_or(|m| g.bytes < m))
            .map_or(0, |g| g.inode);
        (group, available.map_or(mine, process::auto_budget))
    } else {
        (0, mine)
    };
    let mut status = [0.0f32; 16];
    for (i, n) in [mine, machine_budget, machine as usize, group as usize]
        .into_iter()
        .enumerate()
    {
        status[4 * i..4 * i + 4].copy_from_slice(&words(n));
    }
    let mut all = vec![0.0; status.len() * t.size()];
    t.all_gather(&status, &mut all);
    let ranks: Vec<[usize; 4]> = all
        .chunks_exact(status.len())
        .map(|s| [0, 1, 2, 3].map(|i| from_words(&s[4 * i..4 * i + 4])))
        .collect();
    let sharing = |same: &dyn Fn(&[usize; 4]) -> bool| ranks.iter().filter(|r| same(r)).count();
    ranks
        .iter()
        .map(|&[budget, machine_budget, machine, group]| {
            let on_machine = sharing(&|r| r[2] == machine).max(1);
            let in_group = sharing(&|r| r[2] == machine && r[3] == group).max(1);
            (budget / in_group).min(machine_budget / on_machine)
        })
        .min()
        .unwrap_or(mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_cross_as_16_bit_words_exactly() {
        for n in [0, 1, 65_535, 65_536, 328_174_080, usize::MAX] {
            assert_eq!(from_words(&words(n)), n);
        }
    }
}
