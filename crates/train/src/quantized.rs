//! Frozen weights stored quantized ([`QuantizeBase`]): quantized from their f32 values as the
//! session loads them, and read back as the f32 values the step computes with (for
//! checkpoints, sampling and export).

use snug_graph::ops::{Op, QuantizeBase};
use snug_graph::passes::absmax_name;
use snug_graph::{DType, Graph, TensorId};

use snug_runtime::RuntimeError;

use crate::{StepSession, TrainError};

/// Where weights are written: a training step's session or a sampler's.
pub(crate) trait WeightStore {
    fn graph(&self) -> &Graph;
    fn put_f32(&mut self, t: TensorId, v: &[f32]) -> Result<(), RuntimeError>;
    fn put_bytes(&mut self, t: TensorId, v: &[u8]) -> Result<(), RuntimeError>;
    fn get_f32(&self, t: TensorId) -> Result<Vec<f32>, RuntimeError>;
    fn get_bytes(&self, t: TensorId) -> Result<Vec<u8>, RuntimeError>;
}

impl WeightStore for StepSession {
    fn graph(&self) -> &Graph {
        StepSession::graph(self)
    }
    fn put_f32(&mut self, t: TensorId, v: &[f32]) -> Result<(), RuntimeError> {
        self.write_f32(t, v)
    }
    fn put_bytes(&mut self, t: TensorId, v: &[u8]) -> Result<(), RuntimeError> {
        self.write_bytes(t, v)
    }
    fn get_f32(&self, t: TensorId) -> Result<Vec<f32>, RuntimeError> {
        Ok(self.read_f32(t)?.into_owned())
    }
    fn get_bytes(&self, t: TensorId) -> Result<Vec<u8>, RuntimeError> {
        self.read_bytes(t)
    }
}

impl WeightStore for snug_cpu::CpuSession {
    fn graph(&self) -> &Graph {
        snug_runtime::Session::graph(self)
    }
    fn put_f32(&mut self, t: TensorId, v: &[f32]) -> Result<(), RuntimeError> {
        self.write_f32(t, v)
    }
    fn put_bytes(&mut self, t: TensorId, v: &[u8]) -> Result<(), RuntimeError> {
        self.write_bytes(t, v)
    }
    fn get_f32(&self, t: TensorId) -> Result<Vec<f32>, RuntimeError> {
        Ok(self.read_f32(t)?.into_owned())
    }
    fn get_bytes(&self, t: TensorId) -> Result<Vec<u8>, RuntimeError> {
        self.read_bytes(t)
    }
}

/// The absmax tensor stored beside quantized weight `t`.
fn absmax_of(graph: &Graph, t: TensorId) -> Result<TensorId, TrainError> {
    let name = absmax_name(&graph.tensor(t).name);
    graph
        .tensors()
        .iter()
        .position(|m| m.name == name)
        .map(|i| TensorId(i as u32))
        .ok_or_else(|| TrainError::Config {
            field: "quantize_base",
            detail: format!("the step holds no `{name}` beside its quantized weight"),
        })
}

/// The shape of the f32 values parameter `t` holds (a quantized weight's codes are shaped
/// otherwise).
pub fn value_shape(graph: &Graph, t: TensorId) -> &[usize] {
    graph
        .nodes()
        .iter()
        .find_map(|n| match &n.op {
            Op::Dequantize(d) if n.inputs.first() == Some(&t) => Some(d.shape.as_slice()),
            Op::QuantizedRead(q) if n.inputs.get(q.weight) == Some(&t) => Some(q.shape.as_slice()),
            _ => None,
        })
        .unwrap_or(graph.tensor(t).shape.as_slice())
}

/// The absmax tensors of the quantized weights: stored beside them, saved with them.
pub(crate) fn absmax_tensors(graph: &Graph) -> std::collections::HashSet<TensorId> {
    graph
        .nodes()
        .iter()
        .filter_map(|n| match &n.op {
            Op::Dequantize(_) => n.inputs.get(1).copied(),
            Op::QuantizedRead(q) if q.base.scheme().is_some() => {
                n.inputs.get(q.weight + 1).copied()
            }
            _ => None,
        })
        .collect()
}

/// Suffix of the checkpoint entry that holds a double-quantized weight's codes (u8, as the
/// session stores them: the NF4 codes, then the block scales' codes); the weight's f32
/// statistics (the scales of those codes, then their offset) sit beside it under their graph
/// name, `<weight>.absmax`.
pub const STORED_CODES_SUFFIX: &str = ".codes";

/// The frozen weights whose stored form a checkpoint keeps beside their values, each with the
/// f32 tensor stored with it: those of a double-quantized NF4 base. Quantizing NF4 or int8
/// values again gives back their codes, and bf16 values their bits, but double quantization
/// is not idempotent (quantized again, the block scales' mean moves and they round anew), so
/// its codes and statistics cannot be remade from the values: restored from values alone, a
/// base loaded from pretrained weights would change at each resume.
pub(crate) fn stored_forms(
    graph: &Graph,
    base: Option<QuantizeBase>,
) -> Result<Vec<(TensorId, TensorId)>, TrainError> {
    if base != Some(QuantizeBase::Nf4Dq) {
        return Ok(Vec::new());
    }
    let absmax = absmax_tensors(graph);
    (0..graph.tensors().len() as u32)
        .map(TensorId)
        .filter(|&t| {
            let m = graph.tensor(t);
            m.role == snug_graph::Role::Parameter
                && m.view_of.is_none()
                && m.dtype == DType::U8
                && !absmax.contains(&t)
        })
        .map(|t| Ok((t, absmax_of(graph, t)?)))
        .collect()
}

/// Writes double-quantized weight `t` and its statistics `stats` as a checkpoint stored them
/// (`codes`, `scales`), once they are checked to give exactly `values`, the weight's values
/// saved beside them (which the step's readers, sampling and export, take): the restore is
/// then bit for bit whatever the session held.
pub(crate) fn write_stored(
    session: &mut StepSession,
    t: TensorId,
    stats: TensorId,
    codes: &crate::checkpoint::SavedBytes,
    scales: &crate::checkpoint::SavedTensor,
    values: &[f32],
) -> Result<(), TrainError> {
    let graph = session.graph();
    let (weight, held) = (graph.tensor(t), graph.tensor(stats));
    let bad = |detail: String| TrainError::CheckpointMismatch { detail };
    if codes.shape != weight.shape || scales.shape != held.shape {
        return Err(bad(format!(
            "tensors `{}` and `{}` have shapes {:?} and {:?}, the model stores `{}` as {:?} \
             codes and {:?} statistics",
            codes.name,
            scales.name,
            codes.shape,
            scales.shape,
            weight.name,
            weight.shape,
            held.shape
        )));
    }
    let shape = value_shape(graph, t);
    let given = QuantizeBase::Nf4Dq.dequantize(&codes.data, &scales.data, shape);
    let same = given.len() == values.len()
        && given
            .iter()
            .zip(values)
            .all(|(x, y)| x.to_bits() == y.to_bits());
    if !same {
        return Err(bad(format!(
            "tensor `{}` holds other values than its stored codes `{}` and statistics `{}` give",
            weight.name, codes.name, scales.name
        )));
    }
    session.write_bytes(t, &codes.data)?;
    session.write_f32(stats, &scales.data)?;
    Ok(())
}

/// Writes parameter `t` of the session's graph from its f32 `values`, quantizing them as the
/// graph stores it (`base`: how its quantized weights are stored).
pub(crate) fn write_param(
    session: &mut impl WeightStore,
    base: Option<QuantizeBase>,
    t: TensorId,
    values: &[f32],
) -> Result<(), TrainError> {
    let graph = session.graph();
    let base = match (graph.tensor(t).dtype, base) {
        (DType::F32, _) | (_, None) => return Ok(session.put_f32(t, values)?),
        (_, Some(base)) => base,
    };
    let shape = value_shape(graph, t);
    let n: usize = shape.iter().product();
    if values.len() != n {
        return Err(TrainError::Config {
            field: "parameters",
            detail: format!(
                "`{}` has {} values, its shape {shape:?} holds {n}",
                graph.tensor(t).name,
                values.len()
            ),
        });
    }
    let scales = match base.scheme() {
        Some(_) => Some(absmax_of(graph, t)?),
        None => None,
    };
    if base == QuantizeBase::Nf4Dq {
        // Quantizing a double-quantized base's values again rounds its block scales a second
        // time (their mean offset moves), so where the stored codes already give exactly these
        // values (a checkpoint restored over the base it was trained on) they are kept: the
        // restore is then bit for bit. (A checkpoint holds the codes it needs since version 3,
        // restored by `write_stored`; this serves those saved before.)
        if let Some(a) = scales {
            let shape = shape.to_vec();
            let (codes, stats) = (session.get_bytes(t)?, session.get_f32(a)?);
            let held = base.dequantize(&codes, &stats, &shape);
            if held.len() == values.len()
                && held
                    .iter()
                    .zip(values)
                    .all(|(x, y)| x.to_bits() == y.to_bits())
            {
                return Ok(());
            }
        }
    }
    let graph = session.graph();
    let shape = value_shape(graph, t);
    let (codes, absmax) = base.quantize(values, shape);
    session.put_bytes(t, &codes)?;
    if let Some(a) = scales {
        session.put_f32(a, &absmax)?;
    }
    Ok(())
}

/// The f32 values the step reads for parameter `t` (its dequantized values when it
/// is stored quantized).
pub(crate) fn read_param(
    session: &StepSession,
    graph: &Graph,
    base: Option<QuantizeBase>,
    t: TensorId,
) -> Result<Vec<f32>, TrainError> {
    let shape = value_shape(graph, t);
    match (graph.tensor(t).dtype, base) {
        (DType::F32, _) | (_, None) => Ok(session.read_f32(t)?.to_vec()),
        (_, Some(base)) => {
            let codes = session.read_bytes(t)?;
            let absmax = match base.scheme() {
                Some(_) => session.read_f32(absmax_of(graph, t)?)?.to_vec(),
                None => Vec::new(),
            };
            Ok(base.dequantize(&codes, &absmax, shape))
        }
    }
}
