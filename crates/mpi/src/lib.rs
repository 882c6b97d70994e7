//! snug's collectives over MPI: the [`Transport`] the step graph's `AllReduce`,
//! `ReduceScatter` and `AllGather` kernels run on when a run is launched by `mpirun` (or
//! `srun`). Rank and size come from MPI's world communicator.
//!
//! MPI itself is the cargo feature `mpi`, so a build without it needs no MPI library: then
//! [`init`] says the binary lacks MPI where a launcher started several ranks, and runs a world
//! of one otherwise.

#[cfg(feature = "mpi")]
use std::sync::Mutex;

#[cfg(feature = "mpi")]
use snug_cpu::kernels::collective::{set_transport, Transport};

/// Why a run over several ranks cannot start.
#[derive(Debug, thiserror::Error)]
pub enum MpiError {
    #[error(
        "launched as one of {ranks} ranks ({launcher}), but this snug was built without MPI: \
         rebuild with `cargo build --features mpi` (needs Open MPI's libopenmpi-dev)"
    )]
    NotBuiltWithMpi {
        ranks: usize,
        launcher: &'static str,
    },
    #[error("MPI could not start: {0}")]
    Init(String),
}

/// The launcher that started this process as one of several ranks, and how many, from the
/// environment variables Open MPI, MPICH/PMI and Slurm set.
pub fn launched_ranks() -> Option<(&'static str, usize)> {
    const VARS: [(&str, &str); 4] = [
        ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
        ("PMI_SIZE", "mpirun (PMI)"),
        ("PMIX_SIZE", "mpirun (PMIx)"),
        ("SLURM_NTASKS", "srun"),
    ];
    VARS.iter().find_map(|&(var, launcher)| {
        let n: usize = std::env::var(var).ok()?.trim().parse().ok()?;
        Some((launcher, n))
    })
}

/// This process's rank among those a launcher started, from the environment (before MPI
/// starts).
pub fn launched_rank() -> Option<usize> {
    [
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "PMIX_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .find_map(|var| std::env::var(var).ok()?.trim().parse().ok())
}

/// This process's rank and the number of ranks: `(0, 1)` before [`init`] or without a launcher.
pub use snug_cpu::kernels::collective::world;

/// Keeps MPI running for as long as it lives; MPI is finalized when it drops (every rank must
/// drop it, after its last collective). A world of one holds nothing.
pub struct MpiSession {
    #[cfg(feature = "mpi")]
    _universe: Option<mpi::environment::Universe>,
}

impl MpiSession {
    /// Ends the job on every rank at once (`MPI_Abort`) with exit status `code`: after an error
    /// on one rank, the others would otherwise wait in their next collective for ever.
    pub fn abort(&self, code: i32) -> ! {
        #[cfg(feature = "mpi")]
        if let Some(u) = &self._universe {
            use mpi::traits::Communicator;
            u.world().abort(code);
        }
        std::process::exit(code)
    }

    /// Whether this process is one of several ranks.
    pub fn is_distributed(&self) -> bool {
        world().1 > 1
    }
}

/// Starts MPI when a launcher started this process (and installs its transport for the
/// collective kernels); otherwise a world of one. Call once, before compiling a step.
pub fn init() -> Result<MpiSession, MpiError> {
    let launched = launched_ranks();
    #[cfg(feature = "mpi")]
    {
        if launched.is_none() {
            return Ok(MpiSession { _universe: None });
        }
        let (universe, _) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| MpiError::Init("MPI was already initialized".into()))?;
        let world = universe.world();
        set_transport(Box::new(MpiTransport::new(world)));
        Ok(MpiSession {
            _universe: Some(universe),
        })
    }
    #[cfg(not(feature = "mpi"))]
    match launched {
        Some((launcher, ranks)) if ranks > 1 => Err(MpiError::NotBuiltWithMpi { ranks, launcher }),
        _ => Ok(MpiSession {}),
    }
}

/// The world communicator as a [`Transport`]. Collectives are issued by one thread at a time
/// (the step's nodes run in order), so MPI runs with `MPI_THREAD_SERIALIZED`.
#[cfg(feature = "mpi")]
pub struct MpiTransport {
    world: mpi::topology::SimpleCommunicator,
    rank: usize,
    size: usize,
    /// The all-reduce's send copy (MPI's in-place flag is not portable through the bindings).
    scratch: Mutex<Vec<f32>>,
    /// Collectives started and not yet waited for, by the address of their receive buffer.
    in_flight: Mutex<Vec<InFlight>>,
}

/// A started collective: its requests (one per MPI-sized chunk).
#[cfg(feature = "mpi")]
struct InFlight {
    recv: usize,
    requests: Vec<mpi::ffi::MPI_Request>,
}

// SAFETY: the communicator is a handle MPI lets any thread use under
// MPI_THREAD_SERIALIZED; every call through it holds `scratch`'s lock or is made by the one
// thread running the step, so no two calls overlap.
#[cfg(feature = "mpi")]
unsafe impl Send for MpiTransport {}
#[cfg(feature = "mpi")]
unsafe impl Sync for MpiTransport {}

#[cfg(feature = "mpi")]
impl MpiTransport {
    fn new(world: mpi::topology::SimpleCommunicator) -> MpiTransport {
        use mpi::traits::Communicator;
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        MpiTransport {
            world,
            rank,
            size,
            scratch: Mutex::new(Vec::new()),
            in_flight: Mutex::new(Vec::new()),
        }
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, Vec<InFlight>> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Elements one MPI call carries: MPI counts are C ints.
#[cfg(feature = "mpi")]
const MAX_COUNT: usize = i32::MAX as usize;

#[cfg(feature = "mpi")]
fn check_count(what: &str, n: usize) {
    // Blocks are bucketed (25 MiB) or one parameter's shard, far below 2^31 elements.
    assert!(
        n <= MAX_COUNT,
        "{what} of {n} elements exceeds MPI's count limit"
    );
}

#[cfg(feature = "mpi")]
impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) {
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        for chunk in buf.chunks_mut(MAX_COUNT) {
            scratch.clear();
            scratch.extend_from_slice(chunk);
            self.world
                .all_reduce_into(&scratch[..], chunk, SystemOperation::sum());
        }
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        use mpi::collective::{CommunicatorCollectives, SystemOperation};
        assert_eq!(send.len(), recv.len() * self.size, "equal blocks");
        check_count("a reduce-scatter block", recv.len());
        let _serial = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.world
            .reduce_scatter_block_into(send, recv, SystemOperation::sum());
    }

    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        use mpi::collective::CommunicatorCollectives;
        assert_eq!(send.len() * self.size, recv.len(), "equal blocks");
        check_count("an all-gather block", send.len());
        let _serial = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.world.all_gather_into(send, recv);
    }

    // The `mpi` crate ties a request to a scope the buffers outlive; here the buffers are
    // planned tensors the step keeps until the wait, so the requests are held raw.
    unsafe fn start_all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) {
        use mpi::ffi;
        use mpi::raw::AsRaw;
        assert_eq!(send.len(), recv.len(), "equal buffers");
        let key = recv.as_ptr() as usize;
        let mut requests = Vec::new();
        for (s, r) in send.chunks(MAX_COUNT).zip(recv.chunks_mut(MAX_COUNT)) {
            let mut request = ffi::RSMPI_REQUEST_NULL;
            // The default error handler aborts the job on failure, so the code is always
            // success.
            ffi::MPI_Iallreduce(
                s.as_ptr().cast(),
                r.as_mut_ptr().cast(),
                s.len() as i32,
                ffi::RSMPI_FLOAT,
                ffi::RSMPI_SUM,
                self.world.as_raw(),
                &mut request,
            );
            requests.push(request);
        }
        self.in_flight().push(InFlight {
            recv: key,
            requests,
        });
    }

    unsafe fn start_reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        use mpi::ffi;
        use mpi::raw::AsRaw;
        assert_eq!(send.len(), recv.len() * self.size, "equal blocks");
        check_count("a reduce-scatter block", recv.len());
        let mut request = ffi::RSMPI_REQUEST_NULL;
        ffi::MPI_Ireduce_scatter_block(
            send.as_ptr().cast(),
            recv.as_mut_ptr().cast(),
            recv.len() as i32,
            ffi::RSMPI_FLOAT,
            ffi::RSMPI_SUM,
            self.world.as_raw(),
            &mut request,
        );
        self.in_flight().push(InFlight {
            recv: recv.as_ptr() as usize,
            requests: vec![request],
        });
    }

    fn wait(&self, recv: usize) {
        let started = {
            let mut in_flight = self.in_flight();
            let at = in_flight.iter().position(|f| f.recv == recv);
            // Start and wait are nodes of one schedule, run in order on every rank.
            at.map(|i| in_flight.remove(i))
        };
        let Some(mut started) = started else {
            panic!("a collective was waited for that was never started");
        };
        for request in &mut started.requests {
            // SAFETY: a request this transport started (or already completed, then null).
            unsafe { mpi::ffi::MPI_Wait(request, mpi::ffi::RSMPI_STATUS_IGNORE) };
        }
    }

    fn progress(&self) {
        let mut in_flight = self.in_flight();
        // SAFETY: reads a constant handle.
        let null = unsafe { mpi::ffi::RSMPI_REQUEST_NULL };
        // One test drives MPI's progress engine for every request in flight.
        let pending = in_flight
            .iter_mut()
            .flat_map(|f| f.requests.iter_mut())
            .find(|r| **r != null);
        if let Some(request) = pending {
            let mut done = 0;
            // SAFETY: as in `wait`; a completed request becomes null, which `wait` accepts.
            unsafe { mpi::ffi::MPI_Test(request, &mut done, mpi::ffi::RSMPI_STATUS_IGNORE) };
        }
    }
}
