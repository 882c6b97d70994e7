//! A kernel's arguments: where each tensor of a node lives ([`TensorArg`]) and the checked
//! view a kernel reads and writes them through ([`Kernel`]).

use std::cell::Cell;
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
            _p: PhantomData,
        }
    }

    fn take(&self, bit: usize) {
        let mask = 1u64 << bit;
        let t = self.taken.get();
        assert!(t & mask == 0, "kernel took the same mutable buffer twice");
        self.taken.set(t | mask);
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
        self.take(32 + i);
        let a = &self.inputs[i];
        // SAFETY: taken once (checked above); disjointness is `Kernel::new`'s contract.
        unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut f32, a.numel) }
    }

    pub fn out_f32(&self, i: usize) -> &'a mut [f32] {
        self.take(i);
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
        self.take(i);
        let a = &self.outputs[i];
        assert_eq!(a.dtype.size_bytes(), 2, "output {i} is not a 16-bit float");
        // SAFETY: as `out_f32`.
        unsafe { std::slice::from_raw_parts_mut(a.ptr as *mut u16, a.numel) }
    }

    /// A u8 input the op updates in place (listed in its `mutates_inputs`).
    pub fn in_mut_u8(&self, i: usize) -> &'a mut [u8] {
        assert!(self.mutable_inputs.contains(&i), "input {i} is not mutable");
        self.take(32 + i);
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
        self.take(63);
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
