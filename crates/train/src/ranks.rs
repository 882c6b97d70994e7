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
// `data`: a path made absolute in each rank's own directory; the contents are compared
// (`data_hash`).
const PER_RANK_KEYS: [&str; 3] = ["out", "threads", "data"];

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
/// included) share its memory, and the ranks under one control-group limit share its room:
/// both this rank's tightest limit and its outermost (a job's, over each step's or task's
/// own) are divided among the ranks under them.
pub fn shared_auto_budget(mine: usize, host_memory: bool) -> usize {
    let Some(t) = installed().filter(|t| t.size() > 1) else {
        return mine;
    };
    use snug_runtime::process;
    let machine = process::machine_id();
    let available = process::machine_available();
    let machine_budget = if host_memory {
        available.map_or(mine, process::auto_budget)
    } else {
        mine
    };
    // (group, budget under it) for the tightest and the outermost limit; 0 for none.
    let limits = if host_memory {
        process::cgroup_limits()
    } else {
        Vec::new()
    };
    let group = |room: Option<&process::CgroupRoom>| {
        room.map_or((0, machine_budget), |g| {
            (g.inode as usize, process::auto_budget(g.bytes))
        })
    };
    let tightest = group(limits.iter().min_by_key(|g| g.bytes));
    let outermost = group(limits.last());
    let mine_words = [
        mine,
        machine_budget,
        machine as usize,
        tightest.0,
        outermost.0,
        outermost.1,
    ];
    let mut status = [0.0f32; 24];
    for (i, n) in mine_words.into_iter().enumerate() {
        status[4 * i..4 * i + 4].copy_from_slice(&words(n));
    }
    let mut all = vec![0.0; status.len() * t.size()];
    t.all_gather(&status, &mut all);
    let ranks: Vec<[usize; 6]> = all
        .chunks_exact(status.len())
        .map(|s| [0, 1, 2, 3, 4, 5].map(|i| from_words(&s[4 * i..4 * i + 4])))
        .collect();
    ranks
        .iter()
        .map(|r| shared_part(r, &ranks))
        .min()
        .unwrap_or(mine)
}

/// One rank's part: `[budget, machine budget, machine, tightest group, outermost group,
/// budget under the outermost]`, each divided among the ranks that share it (a group of 0 is
/// none, which only ranks on the same machine share).
fn shared_part(r: &[usize; 6], ranks: &[[usize; 6]]) -> usize {
    let [budget, machine_budget, machine, tightest, outermost, outer_budget] = *r;
    let sharing =
        |same: &dyn Fn(&[usize; 6]) -> bool| ranks.iter().filter(|o| same(o)).count().max(1);
    let on_machine = sharing(&|o| o[2] == machine);
    let under = |group: usize| sharing(&|o| o[2] == machine && (o[3] == group || o[4] == group));
    let in_tightest = if tightest == 0 {
        on_machine
    } else {
        under(tightest)
    };
    let in_outermost = if outermost == 0 {
        on_machine
    } else {
        under(outermost)
    };
    (budget / in_tightest)
        .min(outer_budget / in_outermost)
        .min(machine_budget / on_machine)
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

    #[test]
    fn ranks_under_one_limit_divide_it_whatever_level_binds_them() {
        const G: usize = 1 << 30;
        // Two ranks on one machine (id 7) of 64 GiB, both under a job (group 100) of 8 GiB;
        // rank 0's step has its own 1 GiB limit (group 200), rank 1's has none.
        let ranks = [
            [G, 64 * G, 7, 200, 100, 8 * G],
            [8 * G, 64 * G, 7, 100, 100, 8 * G],
        ];
        // Rank 0: its 1 GiB alone, the job's 8 GiB shared by both; rank 1: the job's half.
        assert_eq!(shared_part(&ranks[0], &ranks), G);
        assert_eq!(shared_part(&ranks[1], &ranks), 4 * G);
        // No limits: the machine's memory is halved.
        let free = [
            [60 * G, 60 * G, 7, 0, 0, 60 * G],
            [60 * G, 60 * G, 7, 0, 0, 60 * G],
        ];
        assert_eq!(shared_part(&free[0], &free), 30 * G);
        // Ranks on two machines share nothing.
        let apart = [
            [60 * G, 60 * G, 7, 0, 0, 60 * G],
            [60 * G, 60 * G, 8, 0, 0, 60 * G],
        ];
        assert_eq!(shared_part(&apart[0], &apart), 60 * G);
    }
}
