//! The kernel of [`QuantizedRead`]: its reader's kernel with the frozen weight read from its
//! codes. Products decode it as the GEMM packs it ([`crate::gemm::gemm_quantized`]); the
//! embedding decodes the rows it gathers. Every value is bitwise the one a Dequantize (or a
//! bf16 Cast) would have written.

use snug_graph::ops::{Op, QuantizeBase, QuantizedRead};

use super::lm_head_loss::{lm_head_loss, lm_head_loss_backward, Head, HeadInputs};
use crate::gemm::{gemm_quantized, par_for, QuantB};
use crate::kernel::{CpuKernel, Kernel};

impl CpuKernel for QuantizedRead {
    fn run(&self, k: &Kernel<'_>) {
        let s = self.weight;
        let (codes, halves): (&[u8], &[u16]) = match self.base {
            QuantizeBase::Bf16 => (&[], k.in_u16(s)),
            _ => (k.in_u8(s), &[]),
        };
        let absmax = match self.base.scheme() {
            Some(_) => k.in_f32(s + 1),
            None => &[],
        };
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let weight = |tb: bool| QuantB::of(self.base, (codes, halves, absmax), cols, tb);
        let shift = self.stored_inputs() - 1;
        match &*self.reader {
            Op::MatMul(mm) => {
                let Ok(d) = mm.dims(k.in_shape(0), &self.shape) else {
                    unreachable!("shape rule checked at build time")
                };
                let (a, c) = (k.in_f32(0), k.out_f32(0));
                let bias = mm.bias.then(|| k.in_f32(self.input_of(2)));
                let (a_rs, a_cs) = if mm.ta {
                    (1, d.m as isize)
                } else {
                    (d.k as isize, 1)
                };
                let par = par_for(d.m, d.n, d.k, rayon::current_num_threads());
                let ws = k.workspace();
                // SAFETY: the shape rule sized `a`, `c`, the bias and the codes for these
                // dimensions.
                unsafe {
                    gemm_quantized(
                        (d.m, d.n, d.k),
                        (c.as_mut_ptr(), d.n as isize),
                        (a.as_ptr(), a_rs, a_cs),
                        weight(mm.tb),
                        bias,
                        false,
                        par,
                        ws,
                    )
                };
            }
            Op::LmHeadLoss(op) => {
                let at = HeadInputs {
                    shape: &self.shape,
                    shift,
                };
                let ws = k.workspace();
                let (n, v) = (k.in_shape(0)[0], head_vocab(op.tb, &self.shape));
                let (r, c) = snug_graph::ops::lm_head_loss::tile(op.rows, op.cols, n, v);
                let (own, panel) = ws.split_at_mut(r * c + 2 * r + n);
                lm_head_loss(op, k, (Head::Quantized(weight(op.tb), panel), at), own);
            }
            Op::LmHeadLossBackward(op) => {
                let at = HeadInputs {
                    shape: &self.shape,
                    shift,
                };
                let ws = k.workspace();
                let (n, width) = (k.in_shape(0)[0], k.in_shape(0)[1]);
                let v = head_vocab(op.tb, &self.shape);
                let (r, c) = snug_graph::ops::lm_head_loss::tile(op.rows, op.cols, n, v);
                let own = r * c + if c < v { r * width } else { 0 };
                let (own, panel) = ws.split_at_mut(own);
                let head = Head::Quantized(weight(op.tb), panel);
                lm_head_loss_backward(op, k, (head, at), own, None);
            }
            Op::Embedding(_) => {
                let (ids, out) = (k.in_i32(self.input_of(1)), k.out_f32(0));
                let table = weight(false);
                crate::par::rows_mut(
                    out,
                    cols,
                    #[inline(always)]
                    |r0, out_rows| {
                        for (r, row) in out_rows.chunks_exact_mut(cols).enumerate() {
                            // Ids are range-checked when a batch is loaded; a stray one reads zeros.
                            match usize::try_from(ids[r0 + r]).ok().filter(|&i| i < rows) {
                                Some(i) => table.decode_row(i, row),
                                None => row.fill(0.0),
                            }
                        }
                    },
                );
            }
            Op::Narrow(n) => {
                let (out, table) = (k.out_f32(0), weight(false));
                for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                    table.decode_row(n.start + r, row);
                }
            }
            other => unreachable!("`{}` does not read quantized weights", other.name()),
        }
    }
}

fn head_vocab(tb: bool, shape: &[usize]) -> usize {
    snug_graph::ops::lm_head_loss::head_vocab_of(tb, shape)
}
