#!/usr/bin/env python3
"""Writes the Hugging Face fixtures under crates/nn/tests/fixtures/hf/ (see README.md beside this file).

Tiny random-init checkpoints of each architecture snug imports, the logits `transformers` computes
for them on a fixed input, and a small byte-level BPE tokenizer with the ids `tokenizers` gives
for fixed strings and the chat template rendered for fixed conversations. Re-running with the
versions in README.md reproduces the same bytes.

    make_fixtures.py            # (re)write the fixtures
    make_fixtures.py --check    # load the committed fixtures back and compare, write nothing
"""

import argparse
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

import jinja2
import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "crates" / "nn" / "tests" / "fixtures" / "hf"

# Shared shape: small enough that a directory stays a few hundred KB, large enough that GQA
# (4 query heads over 2 key/value heads), rope (head_dim 8: 4 frequencies) and every tensor's
# orientation matter. No two of hidden, kv width, MLP width, vocab and positions are equal, so a
# transposed or swapped tensor fails on shape before it could pass on values.
VOCAB = 320  # = the fixture tokenizer's vocabulary
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 64
MAX_POS = 128
# Special tokens in id order (0, 1, 2), as SmolLM2-Instruct numbers them.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Random init with a larger spread than the architectures' 0.02 so that every block, not only
# the embedding, moves the logits well past the 1e-5 tolerance the Rust tests use.
WEIGHT_STD = 0.1
INPUT_SHAPE = (2, 16)
INPUT_SEED = 1234
# Weight files are written with the one thread count so that re-runs give the same bytes.
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def arch_configs():
    """name -> (config, weight seed, config keys a loader must honour or refuse, notes)."""
    llama_keys = [
        "architectures",
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "pretraining_tp",
        "torch_dtype",
    ]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POS,
        bos_token_id=1,
        eos_token_id=2,
    )
    llama = dict(common, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=False)
    return {
        "gpt2": (
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=MAX_POS,
                n_embd=HIDDEN,
                n_layer=LAYERS,
                n_head=HEADS,
                bos_token_id=0,
                eos_token_id=0,
            ),
            1,
            [
                "architectures",
                "model_type",
                "vocab_size",
                "n_positions",
                "n_embd",
                "n_layer",
                "n_head",
                "n_inner",
                "activation_function",
                "layer_norm_epsilon",
                "tie_word_embeddings",
                "scale_attn_weights",
                "scale_attn_by_inverse_layer_idx",
                "reorder_and_upcast_attn",
                "add_cross_attention",
                "torch_dtype",
            ],
            "GPT-2 defaults (gelu_new, n_inner null = 4 * n_embd, tied LM head: the file has no "
            "lm_head.weight). Tensor names carry the 'transformer.' prefix of GPT2LMHeadModel. "
            "Conv1D weights are stored [in, out]. Every bias and LayerNorm gain is random, not 0/1.",
        ),
        "llama": (
            LlamaConfig(**llama),
            2,
            llama_keys,
            "Untied LM head, rope_theta 100000, rms_norm_eps 1e-5. RMSNorm gains are random.",
        ),
        "llama3_rope_scaling": (
            LlamaConfig(
                **dict(
                    llama,
                    # transformers wants the pre-scaling context below the extended one.
                    max_position_embeddings=1024,
                    rope_scaling={
                        "rope_type": "llama3",
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 128,
                    },
                )
            ),
            2,
            llama_keys,
            "The weights of 'llama' with Llama 3.1 rope scaling (max_position_embeddings 1024 = "
            "factor * original_max_position_embeddings). With head_dim 8 and theta 1e5 "
            "the wavelengths are 6.3, 112, 1987 and 35566 positions against the thresholds 32 "
            "(128 / high_freq_factor) and 128 (128 / low_freq_factor): frequency 0 is kept, 1 is "
            "smoothed, 2 and 3 are divided by the factor (rope_inv_freq below).",
        ),
        "llama_tied": (
            LlamaConfig(**dict(llama, tie_word_embeddings=True, rope_theta=10000.0)),
            3,
            llama_keys,
            "Tied embeddings as SmolLM2 and Llama 3.2 1B: the file has no lm_head.weight. Carries "
            "the fixture tokenizer (tokenizer.json, tokenizer_config.json) as a SmolLM2 directory "
            "does: vocab_size equals the tokenizer's, bos/eos are <|im_start|>/<|im_end|>.",
        ),
        "mistral": (
            MistralConfig(**dict(common, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None)),
            4,
            llama_keys + ["sliding_window"],
            "Mistral v0.3 style: sliding_window null (no windowing), rope_theta 1e6.",
        ),
        "qwen2": (
            Qwen2Config(
                **dict(
                    common,
                    rms_norm_eps=1e-6,
                    rope_theta=1000000.0,
                    bos_token_id=0,
                    eos_token_id=2,
                    tie_word_embeddings=False,
                )
            ),
            5,
            [k for k in llama_keys if k not in ("attention_bias", "mlp_bias", "pretraining_tp", "head_dim")]
            + ["use_sliding_window", "sliding_window", "max_window_layers"],
            "q/k/v projections have biases (random, non-zero); o_proj and the MLP have none. "
            "rms_norm_eps 1e-6, rope_theta 1e6, untied (as Qwen2.5-7B; the 0.5B ties).",
        ),
    }


def randomize(model, seed):
    """Every parameter drawn from one seeded generator, in name order: matrices N(0, WEIGHT_STD),
    norm gains 1 + N(0, 0.1), biases N(0, 0.1). The architectures' own init leaves biases at 0 and
    gains at 1, which a loader could drop without changing a logit."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                p.copy_(noise * WEIGHT_STD)
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:
                p.copy_(1.0 + noise * 0.1)


def hub_spelling(cfg):
    """transformers 5 writes rope settings as `rope_parameters` and the dtype as `dtype`; the
    checkpoints people download (Llama 3.x, SmolLM2, Qwen2.5, Mistral) were written by
    transformers 4 and say `rope_theta`, `rope_scaling` and `torch_dtype`. config.json keeps that
    spelling; config.transformers5.json beside it has transformers 5's own."""
    cfg = copy.deepcopy(cfg)
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        rope = dict(rope)
        cfg["rope_theta"] = rope.pop("rope_theta")
        cfg["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    return cfg


def write_json(path, obj):
    path.write_text(json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def save_checkpoint(model, out, dtype=torch.float32, max_shard_size="50GB"):
    if out.exists():
        shutil.rmtree(out)
    model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    native = json.loads((out / "config.json").read_text())
    write_json(out / "config.transformers5.json", native)
    write_json(out / "config.json", hub_spelling(native))
    gen = out / "generation_config.json"
    if gen.exists():
        write_json(gen, json.loads(gen.read_text()))


def input_ids():
    rng = np.random.RandomState(INPUT_SEED)
    ids = rng.randint(0, VOCAB, size=INPUT_SHAPE)
    # Both ends of the vocabulary, and a repeat, so a gather off by one row shows.
    ids[0, 0], ids[0, 1], ids[1, 5], ids[1, 6] = 0, VOCAB - 1, 7, 7
    return torch.tensor(ids, dtype=torch.long)


def load_logits(path, ids):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    return forward(model, ids), model


def forward(model, ids):
    model = model.float().eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.to(torch.float32)


def f32_text(x):
    """Shortest decimal that reads back as the same f32 (numpy's Dragon4)."""
    s = str(np.float32(x))
    assert np.float32(float(s)) == np.float32(x), s
    return F32(s)


def logits_json(t):
    return {"shape": list(t.shape), "data": [f32_text(x) for x in t.reshape(-1).numpy()]}


class F32(str):
    """An f32 literal written into JSON as a number, verbatim."""


def dumps(obj, level=0):
    """JSON with sorted keys and two-space indent, but a list of numbers or strings (or a short
    list without objects) on one line, so the logits are one line of f32 literals."""
    pad = "  " * (level + 1)
    if isinstance(obj, F32):
        return str(obj)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [pad + json.dumps(k, ensure_ascii=False) + ": " + dumps(obj[k], level + 1) for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + "  " * level + "}"
    if isinstance(obj, list):
        if all(isinstance(x, F32) for x in obj) and obj:
            return "[" + ",".join(obj) + "]"
        flat = not any(isinstance(x, (dict, list)) for x in obj)
        inline = "[" + ", ".join(dumps(x, level + 1) for x in obj) + "]"
        if flat or (not any(isinstance(x, dict) for x in obj) and len(inline) <= 100):
            return inline
        return "[\n" + ",\n".join(pad + dumps(x, level + 1) for x in obj) + "\n" + "  " * level + "]"
    return json.dumps(obj, ensure_ascii=False)


def dump_expected(path, obj):
    text = dumps(obj) + "\n"
    assert json.loads(text) is not None
    path.write_text(text, encoding="utf-8")


def rope_inv_freq(model):
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rot is None:
        return None
    return [f32_text(x) for x in rot.inv_freq.to(torch.float32).numpy()]


def versions():
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
        "jinja2": jinja2.__version__,
        "numpy": np.__version__,
    }


def expected_for(name, path, ids, notes, keys, logits, model, extra=None):
    cfg = json.loads((path / "config.json").read_text())
    honour = {k: cfg.get(k) for k in keys}
    exp = {
        "fixture": name,
        "notes": notes,
        "input_ids": ids.tolist(),
        "logits": logits_json(logits),
        "config_to_honour": honour,
        "rope_inv_freq": rope_inv_freq(model),
        "tensors": tensor_table(path),
        "attn_implementation": "eager",
        "compute_dtype": "float32",
        "versions": versions(),
    }
    exp.update(extra or {})
    return exp


def tensor_table(path):
    """name -> [dtype, shape, file] for every tensor on disk."""
    table = {}
    for f in sorted(path.glob("*.safetensors")):
        with safetensors.safe_open(f, "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                table[k] = [sl.get_dtype(), list(sl.get_shape()), f.name]
    return table


def make_checkpoints(out, check_only):
    ids = input_ids()
    results = {}
    built = {}
    for name, (cfg, seed, keys, notes) in arch_configs().items():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        randomize(model, seed)
        if name == "llama3_rope_scaling":
            # Same weights as 'llama', so the logits differ only by the rope scaling.
            model.load_state_dict(built["llama"].state_dict())
        if name == "qwen2":
            for n, p in model.named_parameters():
                if n.endswith("_proj.bias"):
                    assert p.abs().min() > 0, n
        built[name] = model
        in_memory = forward(model, ids)
        path = out / name
        if not check_only:
            save_checkpoint(model, path)
        logits, loaded = load_logits(path, ids)
        results[name] = (path, logits, in_memory, loaded, keys, notes)

    # Variants of 'llama': the same weights in bf16, and f32 split over several shards.
    llama = built["llama"]
    _, _, llama_keys, _ = arch_configs()["llama"]
    if not check_only:
        save_checkpoint(llama, out / "llama_bf16", dtype=torch.bfloat16)
        save_checkpoint(llama, out / "llama_sharded", max_shard_size="60KB")
    # Rounds the parameters only: `.to(bfloat16)` would round the rope frequencies too, which
    # transformers keeps in f32 when it loads a bf16 checkpoint.
    rounded = copy.deepcopy(llama)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    bf16_ref = forward(rounded, ids)
    logits, loaded = load_logits(out / "llama_bf16", ids)
    results["llama_bf16"] = (
        out / "llama_bf16",
        logits,
        bf16_ref,
        loaded,
        llama_keys,
        "The weights of 'llama' rounded to bf16 on disk (torch_dtype bfloat16); the logits are "
        "transformers' on those bf16 weights upcast to f32, computed in f32.",
    )
    logits, loaded = load_logits(out / "llama_sharded", ids)
    results["llama_sharded"] = (
        out / "llama_sharded",
        logits,
        forward(llama, ids),
        loaded,
        llama_keys,
        "The f32 weights of 'llama' over several shards with model.safetensors.index.json; the "
        "logits equal 'llama''s.",
    )

    llama_logits = results["llama"][1]
    failures = []
    for name, (path, logits, reference, loaded, keys, notes) in results.items():
        diff = (logits - reference).abs().max().item()
        if diff > 1e-6:
            failures.append(f"{name}: reloaded logits differ from the in-memory model by {diff}")
        # Both spellings of the config give the same model.
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp) / name
            shutil.copytree(path, t)
            shutil.copy(t / "config.transformers5.json", t / "config.json")
            alt, _ = load_logits(t, ids)
            if not torch.equal(alt, logits):
                failures.append(f"{name}: config.transformers5.json gives other logits")
        extra = {}
        if name in ("llama3_rope_scaling", "llama_bf16", "llama_sharded"):
            extra["max_abs_diff_from_llama_logits"] = f32_text((logits - llama_logits).abs().max().item())
        exp = expected_for(name, path, input_ids(), notes, keys, logits, loaded, extra)
        if name == "llama_sharded":
            assert len(list(path.glob("model-*.safetensors"))) >= 2, "llama_sharded has one shard"
        if check_only:
            committed = json.loads((path / "expected.json").read_text())
            want = torch.tensor([float(x) for x in committed["logits"]["data"]]).reshape(committed["logits"]["shape"])
            d = (want - logits).abs().max().item()
            if d > 1e-6:
                failures.append(f"{name}: committed logits differ from transformers' by {d}")
            if committed["input_ids"] != exp["input_ids"]:
                failures.append(f"{name}: committed input_ids differ")
            print(f"{name}: max |committed - transformers| = {d:.3g}")
        else:
            dump_expected(path / "expected.json", exp)
    # The rope scaling and the bf16 rounding must each move the logits past the tests' tolerance,
    # or a loader that ignored them would pass.
    for name in ("llama3_rope_scaling", "llama_bf16"):
        d = (results[name][1] - llama_logits).abs().max().item()
        if d < 1e-3:
            failures.append(f"{name}: logits within {d} of llama's")
    return failures


# ---------------------------------------------------------------------------------------------
# Tokenizer

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs on.
Training a small model with limited memory means planning every buffer before the first step.
A tokenizer turns text into ids, and the ids back into text, byte for byte.
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159
Café, naïve, résumé, Zürich, Straße. 日本語のテキスト。 Привет, мир! 🙂
It's, don't, we'll, they're, I've, she'd.
"""

# (ASCII, unicode, whitespace runs, special tokens inside text, a special's prefix that is not one)
TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " leading space and trailing space ",
    "tabs\tand\t\tnew\nlines\n\n\nand   runs    of     spaces",
    "Café naïve Zürich Straße",
    "日本語のテキスト 🙂 👋🏽",
    "It's 3:45pm; don't stop at 12,345.67!",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "text<|endoftext|>more text",
    "<|im_start not special <|im_end",
    "def add(a, b):\n    return a + b\n",
]

# SmolLM2-Instruct's ChatML with a default system prompt, written with block tags on their own
# lines: it renders right only with HF's trim_blocks and lstrip_blocks. raise_exception is the
# function HF's renderer provides.
CHAT_TEMPLATE = """\
{% set default_system = 'You are a tiny test model.' %}
{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('Unknown role: ' + message['role']) }}
{% endif %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system
{{ default_system }}<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "  Paris.  "},
        {"role": "user", "content": "And of Japan? 日本"},
    ],
]
BAD_CONVERSATION = [{"role": "tool", "content": "{}"}]


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, s
    return tok


def tokenizer_config():
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, s in enumerate(SPECIALS)
    }
    # SmolLM2-Instruct's tokenizer_config.json, chat template inside it.
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<|im_start|>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": MAX_POS,
        "pad_token": "<|im_end|>",
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": "<|endoftext|>",
        "vocab_size": VOCAB,
    }


def render_chat(messages, add_generation_prompt):
    """HF's renderer: a sandboxed Jinja environment with trim_blocks and lstrip_blocks."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    cfg = tokenizer_config()
    return env.from_string(CHAT_TEMPLATE).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"],
    )


def make_tokenizer(out, check_only):
    failures = []
    path = out / "tokenizer"
    if check_only:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    else:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        tok = train_tokenizer()
        # tokenizers writes keys in its own fixed order; sort them for a stable diff.
        write_json(path / "tokenizer.json", json.loads(tok.to_str()))
        write_json(path / "tokenizer_config.json", tokenizer_config())
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    encodings = []
    for s in TOKENIZER_STRINGS:
        ids = tok.encode(s, add_special_tokens=True).ids
        encodings.append(
            {
                "text": s,
                "ids": ids,
                "tokens": [tok.id_to_token(i) for i in ids],
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
    chats = []
    for conv in CONVERSATIONS:
        for gen in (False, True):
            text = render_chat(conv, gen)
            chats.append(
                {
                    "messages": conv,
                    "add_generation_prompt": gen,
                    "rendered": text,
                    "ids": tok.encode(text, add_special_tokens=True).ids,
                }
            )
    try:
        render_chat(BAD_CONVERSATION, True)
        failures.append("the bad conversation rendered")
    except jinja2.exceptions.TemplateError as e:
        bad = {"messages": BAD_CONVERSATION, "error": str(e)}

    # transformers' AutoTokenizer reads the same files and gives the same ids, text and chat.
    hf = AutoTokenizer.from_pretrained(path)
    for e in encodings:
        got = hf(e["text"], add_special_tokens=True)["input_ids"]
        if got != e["ids"]:
            failures.append(f"AutoTokenizer ids differ for {e['text']!r}: {got} vs {e['ids']}")
        for skip, key in ((False, "decoded"), (True, "decoded_skip_special")):
            d = hf.decode(e["ids"], skip_special_tokens=skip)
            if d != e[key]:
                failures.append(f"AutoTokenizer decode({skip}) differs for {e['text']!r}: {d!r}")
        if e["decoded"] != e["text"]:
            failures.append(f"byte-level decode does not round-trip {e['text']!r}")
    for c in chats:
        text = hf.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"], tokenize=False)
        if text != c["rendered"]:
            failures.append(f"apply_chat_template renders {text!r}, jinja2 {c['rendered']!r}")
        ids = hf.apply_chat_template(
            c["messages"], add_generation_prompt=c["add_generation_prompt"], tokenize=True, return_dict=False
        )
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids != c["ids"]:
            failures.append(f"apply_chat_template ids {ids} vs {c['ids']}")
    try:
        hf.apply_chat_template(BAD_CONVERSATION, tokenize=False)
        failures.append("apply_chat_template rendered the bad conversation")
    except Exception as e:  # transformers wraps the template error in its own type
        if "Unknown role: tool" not in str(e):
            failures.append(f"apply_chat_template failed otherwise: {e}")

    cfg = tokenizer_config()
    exp = {
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "special_tokens": {s: tok.token_to_id(s) for s in SPECIALS},
        "bos_token": cfg["bos_token"],
        "eos_token": cfg["eos_token"],
        "pad_token": cfg["pad_token"],
        "unk_token": cfg["unk_token"],
        "encode_add_special_tokens": True,
        "encodings": encodings,
        "chat": chats,
        "chat_error": bad,
        "chat_renderer": "jinja2 ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True), "
        "globals: raise_exception(msg) raises; variables: messages, add_generation_prompt, bos_token, "
        "eos_token",
        "training_text": TRAINING_TEXT,
        "versions": versions(),
    }
    if check_only:
        committed = json.loads((path / "expected.json").read_text())
        for key in ("encodings", "chat", "chat_error", "special_tokens", "vocab_size"):
            if committed[key] != exp[key]:
                failures.append(f"tokenizer expected.json: '{key}' differs from what the files give now")
        print(f"tokenizer: {len(encodings)} strings, {len(chats)} chats checked")
    else:
        dump_expected(path / "expected.json", exp)
        # llama_tied is a SmolLM2-shaped directory: its tokenizer travels with it.
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(path / f, out / "llama_tied" / f)
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare the fixtures in --out, write nothing")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    failures = make_checkpoints(args.out, args.check)
    # After the checkpoints: the tokenizer files are copied into llama_tied.
    failures += make_tokenizer(args.out, args.check)
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    if failures:
        sys.exit(1)
    print("ok" if args.check else f"wrote {args.out}")


if __name__ == "__main__":
    main()
