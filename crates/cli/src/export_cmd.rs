//! `snug export`: a checkpoint as a Hugging Face model directory (`config.json`,
//! `model.safetensors` in Hugging Face's names and layouts, and the tokenizer's files when the
//! run has a Hugging Face tokenizer), which transformers' `AutoModelForCausalLM.from_pretrained`
//! loads. GPT-2 and the Llama family (Llama, Mistral, Qwen2); the checkpoint may be a snug run or
//! itself a Hugging Face directory (converted to one f32 file). A LoRA run exports its base
//! model and, beside it, its adapter as PEFT writes one (`adapter_model.safetensors`,
//! `adapter_config.json`), or with `--merge` the model with every adapter folded in; so does a
//! model directory with an adapter beside it.
//!
//! A directory that is not empty is refused unless `--force`, which replaces the files export
//! writes and removes those an earlier model left that loaders would read with the new one;
//! a run directory, and the directory being exported, never. The files are staged and moved
//! in together ([`output::StagedDir`]), so a failure or a kill leaves the earlier model whole.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;
use snug_train::hf_tokenizer::{
    CHAT_TEMPLATE_FILE, CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, TOKENIZER_FILE,
};
use snug_train::output::{self, DirContents};
use snug_train::{HfTokenizerFiles, Tokenizer};

use crate::sample_cmd::Source;

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A run directory (its newest checkpoint), a checkpoint file, or a Hugging Face model
    /// directory.
    #[arg(long, value_name = "PATH")]
    checkpoint: PathBuf,
    /// Directory to write config.json, model.safetensors and the tokenizer's files into
    /// (created if missing). One that is not empty is refused unless --force; a run directory
    /// always.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Write into a directory that is not empty: replace the files export writes there
    /// (config.json, model.safetensors, the tokenizer's and the adapter's), all together once
    /// every one is written, and remove those of them this export does not write, and the files Hugging Face reads
    /// with a model that export never writes (generation_config.json, a slow tokenizer's
    /// files), so no earlier model's file is read with the new one; any other file is left.
    /// Never a run directory, a checkpoint, a directory of sharded weights, or the directory
    /// being exported.
    #[arg(long)]
    force: bool,
    /// Fold a LoRA run's adapters into the base weights (W + alpha/r · B·A) and write the
    /// merged model alone, instead of the base model and a PEFT adapter beside it.
    #[arg(long)]
    merge: bool,
    /// Print what was written (its paths, parameters and bytes, the source and its step), as
    /// JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct ExportReport {
    checkpoint: PathBuf,
    step: u64,
    weights: PathBuf,
    config: PathBuf,
    /// tokenizer.json and what came with it, when the run has a Hugging Face tokenizer.
    tokenizer_files: Vec<PathBuf>,
    parameters: usize,
    bytes: u64,
    /// The PEFT adapter written beside the base model (a LoRA run, or a model directory with
    /// an adapter beside it, exported without --merge).
    #[serde(skip_serializing_if = "Option::is_none")]
    adapter: Option<snug_nn::lora::AdapterExport>,
    /// The adapters were folded into the weights.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    merged: bool,
    /// Files an earlier model left in `--out` that this export does not write and loaders would
    /// read with it, removed (`--force`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    removed: Vec<PathBuf>,
}

/// Every file export may write into its directory: what `--force` replaces.
const EXPORT_FILES: [&str; 8] = [
    snug_nn::hf_checkpoint::CONFIG_FILE,
    snug_nn::hf_checkpoint::WEIGHTS_FILE,
    TOKENIZER_FILE,
    CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    snug_nn::lora::ADAPTER_WEIGHTS_FILE,
    snug_nn::lora::ADAPTER_CONFIG_FILE,
];

/// Files beside a model that Hugging Face's loaders read with it (its generation settings, a
/// slow tokenizer's files): left by an earlier model in a directory `--force` replaces, they
/// would be read with the new one, so those this export does not write go. Weights are not
/// among them: a directory holding sharded weights is refused, and other formats are not read
/// beside safetensors.
const HUB_FILES: [&str; 5] = [
    GENERATION_CONFIG,
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
];

/// Whether `a` and `b` are the same existing directory or file.
fn same_path(a: &Path, b: &Path) -> bool {
    matches!(
        (std::fs::canonicalize(a), std::fs::canonicalize(b)),
        (Ok(a), Ok(b)) if a == b
    )
}

/// A character tokenizer as Hugging Face files: a `tokenizer.json` that splits text into
/// characters, gives each its id and joins them back without spaces, and a
/// `tokenizer_config.json` naming the plain fast tokenizer, so `transformers` adds no token
/// (a Llama's BOS) of its own. Checked before anything is written: it encodes and decodes the
/// vocabulary as the run did, refuses a character outside it, and declares no unknown token
/// outside it.
fn char_tokenizer_files(tokenizer: &Tokenizer) -> Result<HfTokenizerFiles> {
    let snug_train::TokenizerSpec::Char { chars } = tokenizer.to_spec() else {
        bail!("not a character tokenizer");
    };
    // Each character a piece of its own, its id its place in the list.
    let vocab: Vec<serde_json::Value> = chars
        .chars()
        .map(|c| serde_json::json!([c.to_string(), 0.0]))
        .collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Split",
            // Any one character, newlines too, in Oniguruma (Python's `tokenizers`) as in
            // fancy-regex, which has no inline flags in common.
            "pattern": { "Regex": "[\\s\\S]" },
            "behavior": "Isolated",
            "invert": false
        },
        "post_processor": null,
        "decoder": { "type": "Fuse" },
        // A character outside the vocabulary is an error, as it is to the run's tokenizer. A
        // Unigram model may declare no unknown token (`unk_id` null), and then refuses what
        // it cannot piece together; a WordLevel must name one, which here could only be a
        // token outside the vocabulary (the `<unk>` earlier exports declared), and a BPE
        // without one drops the character.
        "model": {
            "type": "Unigram",
            "unk_id": null,
            "vocab": vocab,
            "byte_fallback": false
        }
    });
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000_000_000_000_000u64,
        "clean_up_tokenization_spaces": false
    });
    let files = HfTokenizerFiles {
        tokenizer_json: serde_json::to_string_pretty(&json)?,
        tokenizer_config_json: Some(serde_json::to_string_pretty(&config)?),
        chat_template_jinja: None,
        special_tokens_map_json: None,
    };
    let hf = snug_train::HfTokenizer::from_files(files.clone(), Path::new("."))?;
    let ids: Vec<u32> = (0..chars.chars().count() as u32).collect();
    if hf.encode(&chars, false)? != ids || hf.decode(&ids, false) != chars {
        bail!("the character vocabulary does not round-trip through a tokenizer.json");
    }
    let outside = ['\u{FFFD}', '\u{0}', 'Z', 'z']
        .into_iter()
        .find(|c| !chars.contains(*c));
    if outside.is_some_and(|c| hf.encode(&c.to_string(), false).is_ok()) {
        bail!("the character tokenizer.json encodes a character outside its vocabulary");
    }
    if let Some(unk) = unknown_token_outside_vocab(&json["model"]) {
        bail!(
            "the character tokenizer.json declares an unknown token ({unk}) outside its vocabulary"
        );
    }
    Ok(files)
}

/// The unknown token a `tokenizer.json` model declares where its vocabulary lacks it: text
/// outside the vocabulary then fails to encode with "Missing [UNK] token", which reads as if
/// the file were damaged.
fn unknown_token_outside_vocab(model: &serde_json::Value) -> Option<String> {
    match (&model["unk_token"], &model["unk_id"], &model["vocab"]) {
        (serde_json::Value::String(unk), _, serde_json::Value::Object(vocab)) => {
            (!vocab.contains_key(unk)).then(|| format!("{unk:?}"))
        }
        (_, serde_json::Value::Number(id), serde_json::Value::Array(vocab)) => id
            .as_u64()
            .filter(|&id| id as usize >= vocab.len())
            .map(|id| format!("id {id}")),
        _ => None,
    }
}

/// A Hugging Face tokenizer's files to write: as they were, except a character tokenizer's
/// `tokenizer.json` as an earlier export wrote it (a WordLevel declaring `<unk>`, which its
/// vocabulary lacks), written as export writes one now: the same ids for every text it
/// encoded, and a character outside the vocabulary still an error. Another tokenizer is kept
/// as its authors wrote it.
fn hf_tokenizer_files(tokenizer: &snug_train::HfTokenizer) -> Result<HfTokenizerFiles> {
    let files = tokenizer.files().clone();
    let json: serde_json::Value = serde_json::from_str(&files.tokenizer_json)
        .context("the tokenizer's tokenizer.json is not JSON")?;
    if unknown_token_outside_vocab(&json["model"]).is_none() {
        return Ok(files);
    }
    // Its vocabulary as a character list in id order, if it is one.
    let chars: Option<String> = (0..tokenizer.vocab_size() as u32)
        .map(|id| {
            let token = tokenizer.id_to_token(id)?;
            let mut it = token.chars();
            it.next().filter(|_| it.next().is_none())
        })
        .collect();
    let Some(chars) = chars else {
        return Ok(files);
    };
    let as_chars = match Tokenizer::from_spec(&snug_train::TokenizerSpec::Char { chars }) {
        Ok(t) if t.same_ids(&Tokenizer::Hf(tokenizer.clone())) => t,
        _ => return Ok(files),
    };
    Ok(HfTokenizerFiles {
        tokenizer_json: char_tokenizer_files(&as_chars)?.tokenizer_json,
        ..files
    })
}

/// The tokenizer's files to write beside the weights, by name.
fn tokenizer_files(files: &HfTokenizerFiles) -> Vec<(&'static str, &str)> {
    let mut out = vec![(TOKENIZER_FILE, files.tokenizer_json.as_str())];
    if let Some(t) = &files.tokenizer_config_json {
        out.push((CONFIG_FILE, t.as_str()));
    }
    if let Some(t) = &files.chat_template_jinja {
        out.push((CHAT_TEMPLATE_FILE, t.as_str()));
    }
    if let Some(t) = &files.special_tokens_map_json {
        out.push((SPECIAL_TOKENS_MAP_FILE, t.as_str()));
    }
    out
}

/// The base model an exported adapter names: the directory it is written into, so
/// `train --init-from` that directory continues its adapters. The directory may not exist
/// until the files move in.
fn adapter_base(out: &Path) -> String {
    std::fs::canonicalize(out)
        .or_else(|_| std::path::absolute(out))
        .unwrap_or_else(|_| out.to_path_buf())
        .display()
        .to_string()
}

/// The token ids a Hugging Face config names (`bos_token_id`, `eos_token_id`, `pad_token_id`):
/// the source's own config.json's where the model came from one (a Llama 3's list of EOS ids
/// included), else its tokenizer's special tokens (GPT-2's BPE: `<|endoftext|>`, 50256). A
/// character tokenizer has none. Without them transformers takes its class defaults, which
/// name other tokens, and `generate()` never stops at the model's end of text.
fn token_ids(
    source: &Source,
    tokenizer: Option<&Tokenizer>,
) -> serde_json::Map<String, serde_json::Value> {
    const KEYS: [&str; 3] = ["bos_token_id", "eos_token_id", "pad_token_id"];
    let original = match source {
        Source::Run(_, ckpt) => ckpt.config.model.hf_config_text.clone(),
        Source::Hf(c) => std::fs::read_to_string(c.dir().join("config.json")).ok(),
    };
    let original = original.and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let ids: [Option<u32>; 3] = match tokenizer {
        Some(Tokenizer::Hf(t)) => {
            let s = t.special_tokens();
            [&s.bos, &s.eos, &s.pad].map(|t| t.as_ref().map(|t| t.id))
        }
        Some(t @ Tokenizer::Gpt2(_)) => {
            let end = t.eos_id();
            [end, end, None]
        }
        _ => [None; 3],
    };
    // Key by key: a config.json that names some ids keeps them, the tokenizer fills the rest.
    KEYS.iter()
        .zip(ids)
        .filter_map(|(&k, id)| {
            let own = original.as_ref().and_then(|c| c.get(k)).cloned();
            Some((k.to_string(), own.or(id.map(serde_json::Value::from))?))
        })
        .collect()
}

/// Adds `ids` to the config.json just written at `path`, and writes generation_config.json
/// beside it: the source directory's own where it has one (its sampling settings), else
/// transformers' form of one made from the config. Returns its path, if written.
fn write_token_ids(
    path: &Path,
    ids: &serde_json::Map<String, serde_json::Value>,
    source: &Source,
) -> Result<Option<PathBuf>> {
    if !ids.is_empty() {
        let text = std::fs::read_to_string(path)?;
        let mut config: serde_json::Value = serde_json::from_str(&text)?;
        if let serde_json::Value::Object(c) = &mut config {
            c.extend(ids.clone());
        }
        snug_nn::hf_checkpoint::write_file_atomically(
            path,
            serde_json::to_string_pretty(&config)?.as_bytes(),
        )?;
    }
    let own = match source {
        Source::Hf(c) => std::fs::read_to_string(c.dir().join(GENERATION_CONFIG)).ok(),
        Source::Run(..) => None,
    };
    let text = match own {
        Some(text) => text,
        None if ids.is_empty() => return Ok(None),
        None => {
            let mut g = serde_json::Map::new();
            g.insert("_from_model_config".into(), true.into());
            g.extend(ids.clone());
            serde_json::to_string_pretty(&g)?
        }
    };
    let generation = path.with_file_name(GENERATION_CONFIG);
    snug_nn::hf_checkpoint::write_file_atomically(&generation, text.as_bytes())?;
    Ok(Some(generation))
}

/// The most export reads of a model directory's `special_tokens_map.json` (a few hundred
/// bytes in practice).
const MAX_SPECIAL_TOKENS_MAP_BYTES: u64 = 16 << 20;

/// transformers' generation settings file.
const GENERATION_CONFIG: &str = "generation_config.json";

pub fn run(args: ExportArgs) -> Result<()> {
    if same_path(&args.out, &args.checkpoint) {
        bail!(
            "--out {}: is the model being exported (--checkpoint); export into another directory",
            args.out.display()
        );
    }
    let writes: Vec<&str> = EXPORT_FILES
        .iter()
        .chain([&GENERATION_CONFIG])
        .copied()
        .collect();
    output::check_dir(&args.out, &writes, DirContents::Nothing, args.force)?;
    let source = Source::open(&args.checkpoint)?;
    let model = source.model()?;
    // Everything is read and checked before anything is written.
    let tokenizer = match &source {
        Source::Run(..) => Some(source.tokenizer()?),
        Source::Hf(c) => c
            .dir()
            .join(TOKENIZER_FILE)
            .exists()
            .then(|| source.tokenizer())
            .transpose()?,
    };
    if let Some(t) = &tokenizer {
        t.check_model_vocab(model.vocab_size())?;
    }
    let mut hf_files = match &tokenizer {
        Some(Tokenizer::Hf(t)) => Some(hf_tokenizer_files(t)?),
        Some(t @ Tokenizer::Char(_)) => Some(char_tokenizer_files(t)?),
        _ => None,
    };
    // The tokenizer keeps special_tokens_map.json only where transformers reads it (a run's
    // checkpoint likewise); a model directory's is carried over as it is whatever its config,
    // so an export loses none of the directory's tokenizer files.
    if let (Source::Hf(c), Some(Tokenizer::Hf(_)), Some(files)) =
        (&source, &tokenizer, &mut hf_files)
    {
        let map = c.dir().join(SPECIAL_TOKENS_MAP_FILE);
        if files.special_tokens_map_json.is_none() && std::fs::symlink_metadata(&map).is_ok() {
            files.special_tokens_map_json = Some(snug_train::user_file::read_text(
                &map,
                MAX_SPECIAL_TOKENS_MAP_BYTES,
                "a tokenizer file",
            )?);
        }
    }
    let lora = match &source {
        Source::Run(_, ckpt) => ckpt.config.lora_config(),
        Source::Hf(c) if snug_nn::lora::is_adapter_dir(c.dir()) => {
            Some(snug_nn::lora::read_adapter_config(c.dir(), &model)?.0)
        }
        Source::Hf(_) => None,
    };
    if args.merge && lora.is_none() {
        bail!(
            "--merge: {} holds no LoRA adapter to merge (a run trained with --lora, or a model \
             directory with adapter_config.json beside it)",
            args.checkpoint.display()
        );
    }
    if args.out.join(snug_nn::hf_checkpoint::INDEX_FILE).exists() {
        bail!(
            "{}: holds a sharded checkpoint ({}); export into another directory",
            args.out.display(),
            snug_nn::hf_checkpoint::INDEX_FILE
        );
    }
    // Written beside the output and moved in together: an error or a kill part-way leaves an
    // earlier export whole, never new weights beside its adapter or tokenizer.
    let staged = output::StagedDir::new(&args.out)?;
    // What an export of an earlier version, which wrote in place, left when it was killed.
    for name in EXPORT_FILES {
        snug_nn::remove_stale_temporaries(&args.out, &format!(".{name}."), ".tmp");
    }
    let dir = staged.path();
    let mut adapter = None;
    let written = match (&source, &lora) {
        (source, Some(lora)) if args.merge => {
            let (mut params, adapters) = match source {
                // Merged as it is read.
                Source::Run(_, ckpt) => (ckpt.parameters(), None),
                Source::Hf(c) => {
                    let params = c
                        .parameter_shapes()
                        .into_iter()
                        .map(|(name, _)| Ok((name.clone(), c.read(&name)?)))
                        .collect::<Result<Vec<_>, snug_nn::NnError>>()?;
                    (
                        params,
                        Some(snug_nn::lora::load_peft_adapter(c.dir(), &model)?),
                    )
                }
            };
            if let Some(a) = adapters {
                params.extend(a.tensors);
                snug_nn::lora::merge_adapters(&model, lora, &mut params)?;
            }
            snug_nn::save_hf_model_from(dir, &model, &params)?
        }
        (Source::Run(_, ckpt), lora) => {
            // Straight from the loaded checkpoint: no second copy of its weights.
            let read = |name: &str, out: &mut [f32]| -> Result<(), snug_nn::NnError> {
                let t = ckpt.tensor(name).filter(|t| t.data.len() == out.len());
                let t = t.ok_or_else(|| snug_nn::NnError::MissingTensor {
                    path: args.checkpoint.display().to_string(),
                    name: name.to_string(),
                })?;
                out.copy_from_slice(&t.data);
                Ok(())
            };
            let written = snug_nn::save_hf_model(dir, &model, &read)?;
            if let Some(lora) = lora {
                let read = |name: &str| ckpt.tensor(name).map(|t| t.data.clone());
                adapter = Some(snug_nn::lora::save_peft_adapter(
                    dir,
                    &model,
                    lora,
                    Some(&adapter_base(&args.out)),
                    &read,
                )?);
            }
            written
        }
        (Source::Hf(ckpt), lora) => {
            // Read before anything is written, so a damaged adapter is refused first.
            let peft = match lora {
                Some(_) => Some(snug_nn::lora::load_peft_adapter(ckpt.dir(), &model)?),
                None => None,
            };
            let read = |name: &str, out: &mut [f32]| ckpt.read_into(name, out);
            let written = snug_nn::save_hf_model(dir, &model, &read)?;
            // The adapter beside the model goes with it, or the new directory would sample
            // as the bare base.
            if let Some(peft) = peft {
                let read = |name: &str| {
                    let found = peft.tensors.iter().find(|(n, _)| n == name);
                    found.map(|(_, v)| v.clone())
                };
                adapter = Some(snug_nn::lora::save_peft_adapter(
                    dir,
                    &model,
                    &peft.lora,
                    Some(&adapter_base(&args.out)),
                    &read,
                )?);
            }
            written
        }
    };
    let mut tokenizer_paths = Vec::new();
    if let Some(files) = &hf_files {
        for (name, text) in tokenizer_files(files) {
            let path = dir.join(name);
            snug_nn::hf_checkpoint::write_file_atomically(&path, text.as_bytes())
                .with_context(|| format!("writing {}", args.out.join(name).display()))?;
            tokenizer_paths.push(staged.final_path(&path));
        }
    }
    let generation = write_token_ids(
        &written.config,
        &token_ids(&source, tokenizer.as_ref()),
        &source,
    )
    .with_context(|| format!("writing the token ids into {}", args.out.display()))?
    .map(|p| staged.final_path(&p));
    let (weights, config) = (
        staged.final_path(&written.weights),
        staged.final_path(&written.config),
    );
    if let Some(a) = &mut adapter {
        a.weights = staged.final_path(&a.weights);
        a.config = staged.final_path(&a.config);
    }
    // An earlier export's files this one did not write (its adapter beside a merged model,
    // its tokenizer where this model has none) would be read with the new ones.
    let mut written_paths = vec![weights.clone(), config.clone()];
    written_paths.extend(tokenizer_paths.iter().cloned());
    if let Some(a) = &adapter {
        written_paths.extend([a.weights.clone(), a.config.clone()]);
    }
    let mut removed = output::stale_files(&args.out, &EXPORT_FILES, &written_paths);
    let hub_written: Vec<PathBuf> = generation.iter().cloned().collect();
    removed.extend(output::stale_files(&args.out, &HUB_FILES, &hub_written));
    let replaceable: Vec<&str> = EXPORT_FILES.iter().chain(&HUB_FILES).copied().collect();
    // The configurations last: a kill part-way leaves no loadable mix (see
    // `commit_replacing`), neither as a model nor as a PEFT adapter.
    staged
        .commit_replacing(
            &replaceable,
            &removed,
            &[
                snug_nn::hf_checkpoint::CONFIG_FILE,
                snug_nn::lora::ADAPTER_CONFIG_FILE,
            ],
        )
        .context(
            "moving the export into place: the directory may now hold part of it, without a \
             config.json or adapter_config.json, which nothing loads; export again",
        )?;
    // Gone already where the directory was replaced whole.
    for path in removed
        .iter()
        .filter(|p| std::fs::symlink_metadata(p).is_ok())
    {
        std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    }
    let report = ExportReport {
        checkpoint: source.path(),
        step: source.step(),
        weights,
        config,
        tokenizer_files: tokenizer_paths,
        parameters: written.parameters,
        bytes: written.bytes,
        adapter,
        merged: args.merge,
        removed,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let extra = match report.tokenizer_files.len() {
            0 => String::new(),
            n => format!(" and {n} tokenizer file(s)"),
        };
        println!(
            "wrote {} ({} parameters, {} bytes), {}{extra} from {} (step {})",
            report.weights.display(),
            report.parameters,
            report.bytes,
            report.config.display(),
            report.checkpoint.display(),
            report.step
        );
        if let Some(a) = &report.adapter {
            println!(
                "wrote {} ({} adapter tensors, {} parameters, {} bytes) and {}",
                a.weights.display(),
                a.tensors,
                a.parameters,
                a.bytes,
                a.config.display()
            );
        }
        if report.merged {
            println!("LoRA adapters merged into the weights");
        }
        for path in &report.removed {
            println!("removed {} (an earlier model's)", path.display());
        }
    }
    Ok(())
}
