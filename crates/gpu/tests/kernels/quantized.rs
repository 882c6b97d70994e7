//! u8 codes on the device: `dequantize` (int8, NF4) and `adamw8bit` against the CPU backend's
//! own kernels, on lengths that cross word and block edges, with codes starting at every byte
//! of a word. The bf16 base is read by the f32 cast (`cast.rs`); its decode is checked here
//! against the host's too.

use snug_cpu::{CpuKernel, Kernel, TensorArg};
use snug_gpu::kernels::adamw::AdamWStep;
use snug_gpu::kernels::adamw8bit::{adamw8bit, Moments8bit};
use snug_gpu::kernels::cast::{from_half, Half};
use snug_gpu::kernels::dequantize::dequantize;
use snug_gpu::kernels::ByteSlice;
use snug_gpu::GpuDevice;
use snug_graph::ops::adamw8bit::{blocks, dynamic_code, quantize, BLOCK};
use snug_graph::ops::{AdamW, AdamW8bit, Dequantize, QuantScheme, QuantizeBase};
use snug_graph::DType;
use snug_runtime::ExecCtx;

use crate::common::{gpu, uniform, Init, Tensors};

/// A host tensor the CPU kernel reads or writes: word-aligned bytes and what they hold.
struct Host {
    words: Vec<u32>,
    numel: usize,
    shape: Vec<usize>,
    dtype: DType,
}

impl Host {
    fn f32(v: &[f32]) -> Host {
        Host {
            words: v.iter().map(|x| x.to_bits()).collect(),
            numel: v.len(),
            shape: vec![v.len()],
            dtype: DType::F32,
        }
    }
    fn u8(v: &[u8]) -> Host {
        let mut b = v.to_vec();
        b.resize(v.len().next_multiple_of(4), 0);
        Host {
            words: bytemuck::pod_collect_to_vec(&b),
            numel: v.len(),
            shape: vec![v.len()],
            dtype: DType::U8,
        }
    }
    fn arg(&mut self) -> TensorArg {
        // SAFETY: `words` holds `numel` elements of `dtype`, word-aligned, and outlives the
        // kernel call it is made for.
        unsafe {
            TensorArg::new(
                self.words.as_mut_ptr().cast(),
                self.numel,
                self.shape.clone(),
                self.dtype,
            )
        }
    }
    fn f32s(&self) -> Vec<f32> {
        self.words.iter().map(|&w| f32::from_bits(w)).collect()
    }
    fn bytes(&self) -> Vec<u8> {
        bytemuck::cast_slice::<u32, u8>(&self.words)[..self.numel].to_vec()
    }
}

/// Runs `op`'s CPU kernel on `inputs` and `outputs` (the CPU backend's own code path).
fn cpu_run<K: CpuKernel>(
    op: &K,
    mutable: &'static [usize],
    inputs: &mut [Host],
    outputs: &mut [Host],
    ctx: ExecCtx,
) {
    let ins: Vec<TensorArg> = inputs.iter_mut().map(Host::arg).collect();
    let outs: Vec<TensorArg> = outputs.iter_mut().map(Host::arg).collect();
    // SAFETY: every host tensor is its own allocation, so no two arguments overlap.
    let k = unsafe { Kernel::new(&ins, &outs, None, mutable, None, ctx) };
    op.run(&k);
}

fn dequantize_on_cpu(
    scheme: QuantScheme,
    shape: &[usize],
    codes: &[u8],
    absmax: &[f32],
) -> Vec<f32> {
    let op = Dequantize {
        scheme,
        shape: shape.to_vec(),
    };
    let mut out = [Host::f32(&vec![f32::NAN; shape.iter().product()])];
    out[0].shape = shape.to_vec();
    cpu_run(
        &op,
        &[],
        &mut [Host::u8(codes), Host::f32(absmax)],
        &mut out,
        ExecCtx::default(),
    );
    out[0].f32s()
}

/// Two values agree: bit for bit on a device whose f32 `*`, `/` and `sqrt` round correctly (a
/// CPU driver, lavapipe in CI), else within `ulps` units in the last place.
fn agree(device: &GpuDevice, got: f32, want: f32, ulps: u32) -> bool {
    if got.to_bits() == want.to_bits() {
        return true;
    }
    if device.info().device_type == "CPU" || !got.is_finite() || !want.is_finite() {
        return false;
    }
    let order = |x: f32| {
        let b = x.to_bits() as i64;
        if b >> 31 == 1 {
            -(b & 0x7fff_ffff)
        } else {
            b
        }
    };
    (order(got) - order(want)).unsigned_abs() <= u64::from(ulps)
}

/// int8 (per-column absmax) and NF4 (blocks of 64, two codes a byte) on odd shapes — a final
/// partial word, an odd column count, a partial last NF4 block — with the codes starting at
/// byte 0, 1, 2 and 3 of a word: every value is the CPU kernel's.
#[test]
fn dequantize_matches_the_cpu_kernel_at_every_byte_offset() {
    let Some(device) = gpu() else { return };
    for (scheme, shape) in [
        (QuantScheme::Int8, vec![7usize, 13]),
        (QuantScheme::Nf4, vec![3, 45]),
        (QuantScheme::Nf4, vec![64]),
        (QuantScheme::Int8, vec![1, 3]),
    ] {
        let n: usize = shape.iter().product();
        let base = match scheme {
            QuantScheme::Int8 => QuantizeBase::Int8,
            QuantScheme::Nf4 => QuantizeBase::Nf4,
            // Refused on the GPU by name (its own test), so not in the list above.
            QuantScheme::Nf4Dq => QuantizeBase::Nf4Dq,
        };
        let w = uniform(11 + n as u64, n, -2.0, 2.0);
        let (codes, absmax) = base.quantize(&w, &shape);
        let want = dequantize_on_cpu(scheme, &shape, &codes, &absmax);
        assert!(want.iter().all(|x| x.is_finite()));
        if scheme == QuantScheme::Int8 {
            assert!(
                codes.iter().any(|&c| (c as i8) < 0),
                "negative codes are covered"
            );
        }
        for offset in 0..4usize {
            let mut bytes = vec![0xa5u8; offset];
            bytes.extend(&codes);
            let t = Tensors::new(
                device,
                &[Init::U8(bytes), Init::F32(absmax.clone()), Init::Out(n)],
            );
            t.run(|e, t| {
                let codes = ByteSlice {
                    words: t.get(0),
                    offset: offset as u64,
                };
                dequantize(
                    device,
                    e,
                    scheme,
                    (n, shape[shape.len() - 1]),
                    codes,
                    t.get(1),
                    t.get(2),
                )
            });
            let got = t.read(2);
            for i in 0..n {
                // int8's `absmax / 127` is a division: WGSL allows 2.5 ULP off a CPU driver.
                assert!(
                    agree(device, got[i], want[i], 3),
                    "{scheme:?} {shape:?} from byte {offset}, [{i}]: got {}, cpu {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

/// The bf16 base: its codes through the f32 cast give the host's decode bit for bit.
#[test]
fn a_bf16_base_decodes_as_the_host() {
    let Some(device) = gpu() else { return };
    let n = 77;
    let w = uniform(3, n, -3.0, 3.0);
    let (codes, _) = QuantizeBase::Bf16.quantize(&w, &[n]);
    let want = QuantizeBase::Bf16.dequantize(&codes, &[], &[n]);
    let t = Tensors::new(device, &[Init::U8(codes), Init::Out(n)]);
    t.run(|e, t| from_half(device, e, Half::Bf16, n, t.get(0), t.get(1)));
    let got = t.read(1);
    assert_eq!(
        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
}

/// Three steps of 8-bit AdamW on two full blocks and a partial third of odd length, with no
/// gradient scale, a scale, and an overflowed scale (nothing moves): weights, codes and
/// absmaxes against the CPU kernel's after every step.
#[test]
fn adamw8bit_matches_the_cpu_kernel_over_steps_and_a_partial_block() {
    let Some(device) = gpu() else { return };
    let adamw = AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let op = AdamW8bit { adamw };
    let n = 2 * BLOCK + 37;
    let nb = blocks(n);
    for scale in [None, Some(0.5f32), Some(f32::INFINITY)] {
        let p = uniform(21, n, -1.0, 1.0);
        // Moments of an earlier step: m signed, v ≥ 0, quantized as the optimizer holds them;
        // the second block starts at zero (absmax 0), as a fresh state does.
        let mut m = uniform(22, n, -0.05, 0.05);
        let mut v = uniform(23, n, 0.0, 1e-3);
        m[BLOCK..2 * BLOCK].fill(0.0);
        v[BLOCK..2 * BLOCK].fill(0.0);
        let (mut mq, mut vq) = (vec![0u8; n], vec![0u8; n]);
        let (mut ma, mut va) = (vec![0f32; nb], vec![0f32; nb]);
        quantize(&dynamic_code(true), &m, &mut mq, &mut ma);
        quantize(&dynamic_code(false), &v, &mut vq, &mut va);
        let mut host = vec![
            Host::f32(&p),
            Host::f32(&[]),
            Host::u8(&mq),
            Host::u8(&vq),
            Host::f32(&ma),
            Host::f32(&va),
        ];
        let mut inits = vec![
            Init::F32(p.clone()),
            Init::F32(vec![]),
            Init::U8(mq.clone()),
            Init::U8(vq.clone()),
            Init::F32(ma.clone()),
            Init::F32(va.clone()),
        ];
        if let Some(s) = scale {
            host.push(Host::f32(&[s]));
            inits.push(Init::F32(vec![s]));
        }
        // The state lives on the device across the steps; each step's gradient is fresh.
        let t = Tensors::new(device, &inits);
        for step in 1..=3u64 {
            let g = uniform(30 + step, n, -1.0, 1.0);
            let before = host[0].f32s();
            host[1] = Host::f32(&g);
            let ctx = ExecCtx::step(2e-2, step);
            cpu_run(&op, &[0, 2, 3, 4, 5], &mut host, &mut [], ctx);
            let gt = Tensors::new(device, &[Init::F32(g)]);
            t.run(|e, t| {
                adamw8bit(
                    device,
                    e,
                    AdamWStep {
                        beta1: adamw.beta1,
                        beta2: adamw.beta2,
                        eps: adamw.eps,
                        weight_decay: adamw.weight_decay,
                        lr: ctx.lr,
                        step,
                    },
                    n,
                    [t.get(0), gt.get(0)],
                    Moments8bit {
                        m: ByteSlice::at_start(t.get(2)),
                        v: ByteSlice::at_start(t.get(3)),
                        m_absmax: t.get(4),
                        v_absmax: t.get(5),
                    },
                    scale.map(|_| t.get(6)),
                )
            });
            let what = format!("scale {scale:?}, step {step}");
            let (gp, wp) = (t.read(0), host[0].f32s());
            if scale.is_some_and(|s| !s.is_finite()) {
                assert_eq!(wp, p, "{what}: the CPU skipped the step");
            } else {
                assert_ne!(wp, p, "{what}: the CPU moved the weights");
            }
            for i in 0..n {
                // The step is a quotient of a square root: off a CPU driver each carries a
                // few ULPs of its own (WGSL allows 2.5 each), and where the step outweighs the
                // weight those are many of the weight's ULPs.
                let step_size = (wp[i] - before[i]).abs();
                let near = (gp[i] - wp[i]).abs() <= 8.0 * f32::EPSILON * step_size;
                assert!(
                    agree(device, gp[i], wp[i], 4) || (device.info().device_type != "CPU" && near),
                    "{what}: param[{i}] {} against the CPU's {} (from {})",
                    gp[i],
                    wp[i],
                    before[i]
                );
            }
            for (k, name) in [(4, "m absmax"), (5, "v absmax")] {
                let (got, want) = (t.read(k), host[k].f32s());
                for b in 0..nb {
                    assert!(
                        agree(device, got[b], want[b], 4),
                        "{what}: {name}[{b}] {} against {}",
                        got[b],
                        want[b]
                    );
                }
            }
            for (k, name) in [(2, "m"), (3, "v")] {
                let (got, want) = (t.read_bytes(k), host[k].bytes());
                let exact = device.info().device_type == "CPU";
                for i in 0..n {
                    // Off a CPU driver a moment within the division's ULP of a midpoint
                    // between two entries may take the neighbouring code.
                    let ok = got[i] == want[i] || (!exact && got[i].abs_diff(want[i]) <= 1);
                    assert!(
                        ok,
                        "{what}: {name} code [{i}] {} against {}",
                        got[i], want[i]
                    );
                }
                // The padding past the last code is left as it was.
                assert!(got[n..].iter().all(|&b| b == 0), "{what}: {name} padding");
            }
            // The next step starts from the device's state on both sides, so each step is
            // held to one step's rounding (a code a neighbour apart would otherwise move the
            // CPU's and the device's weights apart by a code book step).
            host[0] = Host::f32(&t.read(0));
            for k in [2, 3] {
                host[k] = Host::u8(&t.read_bytes(k)[..n]);
            }
            for k in [4, 5] {
                host[k] = Host::f32(&t.read(k)[..nb]);
            }
        }
    }
}
