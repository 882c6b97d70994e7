//! Levers: changes to what is trained, not only to how (updates fused into the backward,
//! 8-bit optimizer state, LoRA adapters instead of the whole model, and over a 4-bit base). The search never uses one the user did not allow ([`Levers`], `--allow`), and
//! tries them only when nothing with the user's own math fits: cheapest first, in the order of
//! [`ladder`].

use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;

use serde::{Serialize, Serializer};
use snug_compile::{OptimizerKind, StepConfig};
use snug_graph::ops::QuantizeBase;
use snug_graph::ClipMode;
use snug_nn::{LoraConfig, LoraTargets};

/// The rank of the adapters the LoRA lever adds (QLoRA's and torchtune's common choice); alpha
/// is twice the rank, on every linear layer.
pub const LORA_LEVER_RANK: usize = 16;

/// One change to the training math fit may make when allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lever {
    /// Each parameter updated as soon as its gradient is complete, the gradient freed at once;
    /// global-norm clipping becomes clipping by the previous step's global norm.
    FusedUpdate,
    /// AdamW's moments stored as block-wise 8-bit codes.
    Adam8bit,
    /// Train rank-[`LORA_LEVER_RANK`] adapters on every linear layer; the base is frozen.
    Lora,
    /// LoRA over a base stored in NF4 (QLoRA).
    Qlora,
}

impl Lever {
    pub const ALL: [Lever; 4] = [
        Lever::FusedUpdate,
        Lever::Adam8bit,
        Lever::Lora,
        Lever::Qlora,
    ];

    /// As `--allow` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Lever::FusedUpdate => "fused-update",
            Lever::Adam8bit => "adam8bit",
            Lever::Lora => "lora",
            Lever::Qlora => "qlora",
        }
    }

    /// What choosing it costs, beyond memory (which the search measures).
    pub fn cost(self) -> LeverCost {
        match self {
            Lever::FusedUpdate => LeverCost {
                lever: self,
                quality: "the same updates without clipping or clipping per tensor; global-norm \
                          clipping uses the previous step's norm (the first step unclipped)",
                recompute: "none",
                speed: "the same work; one micro-batch per step (no accumulation)",
            },
            Lever::Adam8bit => LeverCost {
                lever: self,
                quality: "moments rounded to 8-bit dynamic codes per block of 2048 (tensors \
                          under 4096 elements keep f32 moments): loss curves track AdamW's \
                          closely (Dettmers et al. 2022), not bit for bit",
                recompute: "none",
                speed: "the update quantizes and dequantizes each moment: a little slower \
                        optimizer step",
            },
            Lever::Lora => LeverCost {
                lever: self,
                quality: "trains a low-rank update of the linear layers only; the base, \
                          embeddings and norms stay frozen (fine-tuning, not pre-training)",
                recompute: "none",
                speed: "faster: the frozen base has no weight gradients, about half the \
                        backward's matrix products",
            },
            Lever::Qlora => LeverCost {
                lever: self,
                quality: "LoRA's, over a base rounded to 4-bit NormalFloat per block of 64: the \
                          model trained sees quantized weights (QLoRA, Dettmers et al. 2023)",
                recompute: "each frozen weight dequantized tile by tile as its GEMM reads it",
                speed: "slower than LoRA: the dequantization in every frozen GEMM",
            },
        }
    }

    /// `step` with this lever applied; a setting the user made (their own `--lora`) stays.
    fn apply(self, step: &mut StepConfig) {
        match self {
            Lever::FusedUpdate => {
                step.fused_update = true;
                if step.grad_clip > 0.0 && step.clip_mode == ClipMode::Global {
                    step.clip_mode = ClipMode::Previous;
                }
            }
            Lever::Adam8bit => {
                if step.optimizer == OptimizerKind::AdamW {
                    step.optimizer = OptimizerKind::AdamW8bit;
                }
            }
            Lever::Lora => {
                if step.lora.is_none() {
                    step.lora = Some(LoraConfig {
                        rank: LORA_LEVER_RANK,
                        alpha: 2.0 * LORA_LEVER_RANK as f32,
                        targets: LoraTargets::AllLinear,
                    });
                }
            }
            Lever::Qlora => {
                Lever::Lora.apply(step);
                if step.quantize_base.is_none() {
                    step.quantize_base = Some(QuantizeBase::Nf4);
                }
            }
        }
    }
}

impl fmt::Display for Lever {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for Lever {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// What a lever costs, in words a user weighs: the risk to quality, the recomputation and the
/// speed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LeverCost {
    pub lever: Lever,
    pub quality: &'static str,
    pub recompute: &'static str,
    pub speed: &'static str,
}

/// A set of levers: those the user allows, or those a candidate uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize)]
pub struct Levers(BTreeSet<Lever>);

impl Levers {
    pub fn none() -> Levers {
        Levers::default()
    }

    pub fn all() -> Levers {
        Levers(Lever::ALL.into_iter().collect())
    }

    pub fn of(levers: &[Lever]) -> Levers {
        Levers(levers.iter().copied().collect())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, lever: Lever) -> bool {
        self.0.contains(&lever)
    }

    pub fn iter(&self) -> impl Iterator<Item = Lever> + '_ {
        self.0.iter().copied()
    }

    fn is_subset(&self, other: &Levers) -> bool {
        self.0.is_subset(&other.0)
    }

    /// `step` with every lever applied.
    pub fn apply(&self, step: &StepConfig) -> StepConfig {
        let mut step = step.clone();
        for lever in self.iter() {
            lever.apply(&mut step);
        }
        step
    }

    /// Whether these levers can run as one rank of `devices` at ZeRO stage `stage`: fused
    /// updates need every gradient on one device (no bucketed averaging), quantized bases are
    /// not sharded, and stages 1 and 2 shard AdamW's f32 moments, which 8-bit AdamW does not.
    pub fn runs_sharded(&self, devices: usize, stage: u8) -> bool {
        let distributed = devices > 1 || stage > 0;
        let one_device = [Lever::FusedUpdate, Lever::Qlora];
        let apart = distributed && one_device.iter().any(|&l| self.contains(l));
        let eight_bit_sharded = self.contains(Lever::Adam8bit) && matches!(stage, 1 | 2);
        !apart && !eight_bit_sharded
    }

    /// What each lever costs.
    pub fn costs(&self) -> Vec<LeverCost> {
        self.iter().map(Lever::cost).collect()
    }
}

impl fmt::Display for Levers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("none");
        }
        let names: Vec<&str> = self.iter().map(Lever::name).collect();
        f.write_str(&names.join(","))
    }
}

/// A lever name `--allow` does not know, or `all` or `none` among other names (`all,none`
/// was taken as all).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{}: the levers are {}, or `all` or `none` alone",
    if *among_others { format!("`{name}` stands alone, not in a list") } else { format!("unknown lever `{name}`") },
    Lever::ALL.map(Lever::name).join(", ")
)]
pub struct UnknownLever {
    pub name: String,
    /// `all` or `none` given with other names.
    pub among_others: bool,
}

impl FromStr for Levers {
    type Err = UnknownLever;

    /// `lora,adam8bit,...`, `all` or `none` (also the empty string).
    fn from_str(s: &str) -> Result<Levers, UnknownLever> {
        let names: Vec<&str> = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .collect();
        let mut set = BTreeSet::new();
        for &name in &names {
            match name.to_ascii_lowercase().as_str() {
                "all" | "none" if names.len() > 1 => {
                    return Err(UnknownLever {
                        name: name.into(),
                        among_others: true,
                    })
                }
                "all" => set.extend(Lever::ALL),
                "none" => {}
                other => {
                    let lever = Lever::ALL
                        .into_iter()
                        .find(|l| l.name() == other)
                        .ok_or_else(|| UnknownLever {
                            name: name.into(),
                            among_others: false,
                        })?;
                    set.insert(lever);
                }
            }
        }
        Ok(Levers(set))
    }
}

/// The lever sets the search tries, in order of cost (least change to the math first), those
/// `allowed` permits. The first whose candidates fit is used.
pub fn ladder(allowed: &Levers) -> Vec<Levers> {
    let rungs = [
        Levers::of(&[Lever::FusedUpdate]),
        Levers::of(&[Lever::Adam8bit]),
        Levers::of(&[Lever::Adam8bit, Lever::FusedUpdate]),
        Levers::of(&[Lever::Lora]),
        Levers::of(&[Lever::Qlora]),
    ];
    rungs
        .into_iter()
        .filter(|r| !r.is_empty() && r.is_subset(allowed))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_lists_parse_and_unknown_names_are_refused_by_name() {
        assert_eq!(
            "lora".parse::<Levers>().unwrap(),
            Levers::of(&[Lever::Lora])
        );
        assert_eq!(
            " LoRA , ".parse::<Levers>().unwrap(),
            Levers::of(&[Lever::Lora])
        );
        assert_eq!("all".parse::<Levers>().unwrap(), Levers::all());
        assert_eq!("none".parse::<Levers>().unwrap(), Levers::none());
        assert_eq!("".parse::<Levers>().unwrap(), Levers::none());
        let e = "lora,galore".parse::<Levers>().unwrap_err();
        assert_eq!(e.name, "galore");
        assert!(e.to_string().contains("lora"), "{e}");
        // `all,none` was taken as all: either word stands alone.
        for list in ["all,none", "none,lora", "lora, ALL"] {
            let e = list.parse::<Levers>().unwrap_err();
            assert!(e.among_others, "{list}");
            assert!(e.to_string().contains("stands alone"), "{e}");
        }
    }

    #[test]
    fn the_ladder_holds_only_allowed_levers() {
        assert!(ladder(&Levers::none()).is_empty());
        assert_eq!(
            ladder(&Levers::of(&[Lever::Lora])),
            vec![Levers::of(&[Lever::Lora])]
        );
        assert_eq!(
            ladder(&"adam8bit,fused-update".parse().unwrap()),
            vec![
                Levers::of(&[Lever::FusedUpdate]),
                Levers::of(&[Lever::Adam8bit]),
                Levers::of(&[Lever::Adam8bit, Lever::FusedUpdate]),
            ]
        );
        for rung in ladder(&Levers::all()) {
            assert!(rung.is_subset(&Levers::all()));
        }
    }

    #[test]
    fn the_optimizer_levers_set_what_they_name() {
        let step = StepConfig::default();
        let fused = Levers::of(&[Lever::FusedUpdate]).apply(&step);
        assert!(fused.fused_update);
        assert_eq!(fused.clip_mode, ClipMode::Previous);
        let unclipped = StepConfig {
            grad_clip: 0.0,
            ..step.clone()
        };
        assert_eq!(
            Levers::of(&[Lever::FusedUpdate])
                .apply(&unclipped)
                .clip_mode,
            ClipMode::Global
        );
        let eight = Levers::of(&[Lever::Adam8bit]).apply(&step);
        assert_eq!(eight.optimizer, OptimizerKind::AdamW8bit);
        let sgd = StepConfig {
            optimizer: OptimizerKind::Sgd,
            ..step
        };
        assert_eq!(
            Levers::of(&[Lever::Adam8bit]).apply(&sgd).optimizer,
            OptimizerKind::Sgd
        );
    }

    #[test]
    fn the_qlora_lever_is_lora_over_an_nf4_base() {
        let step = Levers::of(&[Lever::Qlora]).apply(&StepConfig::default());
        assert_eq!(step.lora.map(|l| l.rank), Some(LORA_LEVER_RANK));
        assert_eq!(step.quantize_base, Some(QuantizeBase::Nf4));
    }

    #[test]
    fn the_lora_lever_keeps_a_users_own_adapters() {
        let mut step = StepConfig::default();
        let applied = Levers::of(&[Lever::Lora]).apply(&step);
        let lora = applied.lora.expect("the lever adds adapters");
        assert_eq!(lora.rank, LORA_LEVER_RANK);
        assert_eq!(lora.targets, LoraTargets::AllLinear);
        step.lora = Some(LoraConfig {
            rank: 4,
            alpha: 8.0,
            targets: LoraTargets::Modules(vec!["c_attn".into()]),
        });
        assert_eq!(Levers::of(&[Lever::Lora]).apply(&step).lora, step.lora);
    }
}
