//! A kernel's arguments: where each tensor of a node lives ([`TensorArg`]) and the checked
//! view a kernel reads and writes them through ([`Kernel`]).

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;

use snug_graph::DType;
use snug_runtime::ExecCtx;

/// Where one tensor lives while a node runs. Built once per session: buffers never move.
#[derive(Debug, Clone)]
pub struct TensorArg {
    ptr: *mut u8,
    numel: usize,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

// SAFETY: a `TensorArg` is a raw window into a buffer owned by the runtime, which outlives every
// kernel call; the plan guarantees that concurrently written windows are disjoint.
unsafe impl Send for TensorArg {}
unsafe impl Sync for TensorArg {}

impl TensorArg {
    /// # Safety
    /// `ptr` must be valid for `numel` elements of `dtype`, aligned for it, and stay valid for as
    /// long as any kernel reads through this argument.
    pub unsafe fn new(ptr: *mut u8, numel: usize, shape: Vec<usize>, dtype: DType) -> Self {
        TensorArg {
            ptr,
            numel,
            shape,
            dtype,
        }
    }

    pub fn numel(&self) -> usize {
        self.numel
    }
}

/// A buffer a kernel writes: output `i`, mutable input `i`, or its workspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Buffer {
    Output(usize),
    Input(usize),
    Workspace,
}

/// A kernel's view of one node's tensors.
///
/// Output slices are handed out at most once each (checked), so a kernel can hold all its
/// outputs mutably at the same time while reading its inputs.
pub struct Kernel<'a> {
    inputs: &'a [TensorArg],
    outputs: &'a [TensorArg],
    workspace: Option<&'a TensorArg>,
    mutable_inputs: &'static [usize],
    inplace: Option<usize>,
    pub ctx: ExecCtx,
    taken: Cell<u64>,
    /// Buffers taken beyond the bits of `taken` (a collective over more than 32 tensors):
    /// empty, and never allocated, for every other node.
    taken_more: RefCell<Vec<Buffer>>,
    _p: PhantomData<&'a mut [u8]>,
}

impl<'a> Kernel<'a> {
    /// # Safety
    /// Every output and the workspace must be disjoint from every other argument (a plan with
    /// no overlapping live tensors guarantees it), except output 0 and input `inplace`, which
    /// are the same bytes when given; inputs named by `mutable_inputs` must not be read through
    /// any other argument.
    pub unsafe fn new(
        inputs: &'a [TensorArg],
        outputs: &'a [TensorArg],
        workspace: Option<&'a TensorArg>,
        mutable_inputs: &'static [usize],
        inplace: Option<usize>,
        ctx: ExecCtx,
    ) -> Self {
        Kernel {
            inputs,
            outputs,
            workspace,
            mutable_inputs,
            inplace,
            ctx,
            taken: Cell::new(0),
            taken_more: RefCell::new(Vec::new()),
            _p: PhantomData,
        }
    }

    /// Marks `b` handed out, at most once: outputs 0..32 and mutable inputs 0..31 are bits of
    /// `taken` (and the workspace bit 63), any others are listed in `taken_more`.
    fn take(&self, b: Buffer) {
        let bit = match b {
            Buffer::Output(i) if i < 32 => Some(i),
            Buffer::Input(i) if i < 31 => Some(32 + i),
            Buffer::Workspace => Some(63),
            _ => None,
        };
        match bit {
            Some(bit) => {
                let mask = 1u64 << bit;
                let t = self.taken.get();
                assert!(t & mask == 0, "kernel took the same mutable buffer twice");
                self.taken.set(t | mask);
            }
            None => {
                let mut more = self.taken_more.borrow_mut();
                assert!(
                    !more.contains(&b),
                    "kernel took the same mutable buffer twice"
                );
                more.push(b);
            }
        }
    }

    pub fn in_count(&self) -> usize {
        self.inputs.len()
    }

    pub fn in_shape(&self, i: usize) -> &'a [usize] {
        &self.inputs[i].shape
    }

    pub fn out_shape(&self, i: usize) -> &'a [usize] {
        &self.outputs[i].shape
    }

    /// The input output 0 is written over, when the node runs in place: read it through
    /// `out_f32(0)` (reading it as an input would alias the output).
    pub fn inplace(&self) -> Option<usize> {
        self.inplace
    }

    pub fn in_f32(&self, i: usize) -> &'a [f32] {
        assert_ne!(self.inplace, Some(i), "input {i} is the in-place output");
        let a = &self.inputs[i];
        assert_eq!(a.dtype, DType::F32, "input {i} is not f32");
        // SAFETY: see `TensorArg::new`; shared reads of an input are always allowed.
        unsafe { std::slice::from_raw_parts(a.ptr as *const f32, a.numel) }
    }

    pub fn in_i32(&self, i: usize) -> &'a [i32] {
        assert_ne!(self.inplace, Some(i), "input {i} is the in-place output");
        let a = &self.inputs[i];
        assert_eq!(a.dtype, DType::I32, "input {i} is not i32");
        // SAFETY: as `in_f32`.
        unsafe { std::slice::from_raw_parts(a.ptr as *const i32, a.numel) }
    }

    /// An input the op updates in place (listed in its `mutates_inputs`).
    pub fn in_mut_f32(&self, i: usize) -> &'a mut [f32] {
        assert!(self.mutable_inputs.contains(&i), "input {i} is not mutable");
        self.take(Buffer::Input(i));
        let a = &self.inputs[i];
        // SAFETY: taken once (checked above); disjointness is `Kernel::new`'s contract.
        unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut f32, a.numel) }
    }

    pub fn out_f32(&self, i: usize) -> &'a mut [f32] {
        self.take(Buffer::Output(i));
        let a = &self.outputs[i];
        assert_eq!(a.dtype, DType::F32, "output {i} is not f32");
        // SAFETY: taken once (checked above); disjointness is `Kernel::new`'s contract.
        unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut f32, a.numel) }
    }

    /// A 16-bit float input (bf16 or f16, by its dtype) as raw bits.
    pub fn in_u16(&self, i: usize) -> &'a [u16] {
        assert_ne!(self.inplace, Some(i), "input {i} is the in-place output");
        let a = &self.inputs[i];
        assert_eq!(a.dtype.size_bytes(), 2, "input {i} is not a 16-bit float");
        // SAFETY: as `in_f32`.
        unsafe { std::slice::from_raw_parts(a.ptr as *const u16, a.numel) }
    }

    /// A 16-bit float output (bf16 or f16, by its dtype) as raw bits.
    pub fn out_u16(&self, i: usize) -> &'a mut [u16] {
        self.take(Buffer::Output(i));
        let a = &self.outputs[i];
        assert_eq!(a.dtype.size_bytes(), 2, "output {i} is not a 16-bit float");
        // SAFETY: as `out_f32`.
        unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut u16, a.numel) }
    }

    /// A u8 input the op updates in place (listed in its `mutates_inputs`).
    pub fn in_mut_u8(&self, i: usize) -> &'a mut [u8] {
        assert!(self.mutable_inputs.contains(&i), "input {i} is not mutable");
        self.take(Buffer::Input(i));
        let a = &self.inputs[i];
        assert_eq!(a.dtype, DType::U8, "input {i} is not u8");
        // SAFETY: as `in_mut_f32`.
        unsafe { std::slice::from_raw_parts_mut(a.ptr, a.numel) }
    }

    /// A byte input (the codes of a quantized weight).
    pub fn in_u8(&self, i: usize) -> &'a [u8] {
        assert_ne!(self.inplace, Some(i), "input {i} is the in-place output");
        let a = &self.inputs[i];
        assert_eq!(a.dtype, DType::U8, "input {i} is not u8");
        // SAFETY: as `in_f32`.
        unsafe { std::slice::from_raw_parts(a.ptr as *const u8, a.numel) }
    }

    pub fn in_dtype(&self, i: usize) -> DType {
        self.inputs[i].dtype
    }

    pub fn out_dtype(&self, i: usize) -> DType {
        self.outputs[i].dtype
    }

    pub fn workspace(&self) -> &'a mut [f32] {
        self.take(Buffer::Workspace);
        match self.workspace {
            // SAFETY: taken once (checked above); the workspace is private to this node.
            Some(a) => unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut f32, a.numel) },
            None => &mut [],
        }
    }
}

/// An op's CPU kernel. Inputs and outputs never overlap unless the plan says so (an in-place
/// node's output is the input [`Kernel::inplace`] names).
pub trait CpuKernel {
    fn run(&self, k: &Kernel<'_>);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(bufs: &mut [Vec<f32>]) -> Vec<TensorArg> {
        bufs.iter_mut()
            // SAFETY: each vector outlives the kernel that reads it.
            .map(|b| unsafe {
                TensorArg::new(
                    b.as_mut_ptr() as *mut u8,
                    b.len(),
                    vec![b.len()],
                    DType::F32,
                )
            })
            .collect()
    }

    /// A collective over many tensors (a gradient bucket, every parameter's squared norm) hands
    /// out more than 32 outputs: each once, and a second taking of any of them is refused.
    #[test]
    fn more_outputs_than_bits_are_each_taken_once() {
        let mut bufs: Vec<Vec<f32>> = (0..70).map(|i| vec![0.0; 1 + i % 3]).collect();
        let outputs = args(&mut bufs);
        // SAFETY: the outputs are distinct vectors, and no input aliases them.
        let k = unsafe { Kernel::new(&[], &outputs, None, &[], None, ExecCtx::default()) };
        for i in 0..70 {
            k.out_f32(i).fill(i as f32);
        }
        assert!(bufs
            .iter()
            .enumerate()
            .all(|(i, b)| b.iter().all(|&x| x == i as f32)));
        let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: as above.
            let k = unsafe { Kernel::new(&[], &outputs, None, &[], None, ExecCtx::default()) };
            k.out_f32(40);
            k.out_f32(40);
        }));
        assert!(twice.is_err());
    }
}
