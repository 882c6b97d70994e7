//! How a broadcast input's elements map to the output's, for the kernels that broadcast.

/// How elements of a broadcast input map to the output.
#[derive(Debug, Clone)]
pub(crate) enum Mapping {
    /// Same shape: index i reads i.
    Same,
    /// The input repeats every `n` output elements (a bias over the last axes): i reads i % n.
    Cycle(usize),
    /// Each input element covers `n` consecutive outputs (a `[.., 1]` column): i reads i / n.
    Spread(usize),
    /// Anything else: strides per output axis (0 where broadcast).
    Strided {
        out_shape: Vec<usize>,
        strides: Vec<usize>,
    },
}

impl Mapping {
    pub fn new(input: &[usize], out: &[usize]) -> Mapping {
        let n_in: usize = input.iter().product();
        let n_out: usize = out.iter().product();
        if n_in == n_out {
            return Mapping::Same;
        }
        let rank = out.len();
        let padded: Vec<usize> = std::iter::repeat_n(1, rank - input.len())
            .chain(input.iter().copied())
            .collect();
        // Trailing block equal to the output's, ones before it.
        let first_real = padded.iter().position(|&d| d != 1).unwrap_or(rank);
        if padded[first_real..] == out[first_real..] {
            return Mapping::Cycle(n_in);
        }
        // Leading block equal to the output's, ones after it.
        let last_real = padded.iter().rposition(|&d| d != 1).map_or(0, |p| p + 1);
        if padded[..last_real] == out[..last_real] {
            return Mapping::Spread(n_out / n_in);
        }
        let mut strides = vec![0; rank];
        let mut s = 1;
        for i in (0..rank).rev() {
            if padded[i] != 1 {
                strides[i] = s;
            }
            s *= padded[i];
        }
        Mapping::Strided {
            out_shape: out.to_vec(),
            strides,
        }
    }

    /// Input index of output element `i`.
    #[inline]
    pub fn index(&self, i: usize) -> usize {
        match self {
            Mapping::Same => i,
            Mapping::Cycle(n) => i % n,
            Mapping::Spread(n) => i / n,
            Mapping::Strided { out_shape, strides } => {
                let mut rem = i;
                let mut idx = 0;
                for d in (0..out_shape.len()).rev() {
                    idx += (rem % out_shape[d]) * strides[d];
                    rem /= out_shape[d];
                }
                idx
            }
        }
    }
}
