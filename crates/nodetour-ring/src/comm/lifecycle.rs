//! A communicator's life: forming it (from a launcher, a unique id, or the GPUs of one
//! process), waiting for its queued work, and closing it (the teardown handshake).

use super::*;

/// Waits (polling, to `deadline`) until `stream` has run everything queued on it so far.
pub(super) fn stream_done(stream: &GpuStream, deadline: Deadline) -> Result<()> {
    let done = nodetour_core::cuda::GpuEvent::marker(stream.context()).map_err(gpu_error)?;
    stream.record_marker(&done).map_err(gpu_error)?;
    marker_done(&done, deadline, "the caller's stream")
}

/// Waits (spinning briefly, then napping up to 1 ms, to `deadline`) until the work before
/// `marker` has run; `Timeout` naming `what` past the deadline.
pub(super) fn marker_done(
    marker: &nodetour_core::cuda::GpuEvent,
    deadline: Deadline,
    what: &str,
) -> Result<()> {
    let started = std::time::Instant::now();
    let spin_until = started + std::time::Duration::from_micros(50);
    let mut nap = std::time::Duration::from_micros(10);
    while !marker.is_complete().map_err(gpu_error)? {
        if deadline.expired() {
            return Err(Error::Timeout {
                waiting_for: what.to_owned(),
                rank: None,
                after: started.elapsed(),
            });
        }
        if std::time::Instant::now() < spin_until {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(1));
        }
    }
    Ok(())
}

/// Ends a job's GPU ring with the teardown handshake: this rank's streams drained and its
/// mappings of its neighbours' memory closed, then a barrier (or the liveness mesh reporting a
/// rank gone, which counts as closed) says every rank has done the same, and only then is the
/// memory this rank exported freed; past `deadline` it is leaked, never freed under a
/// neighbour's mapping. Without a GPU ring, the barrier alone (every rank is done with every
/// collective before links close) when `orderly`.
pub(super) fn teardown(job: &mut HostJob, deadline: Deadline, orderly: bool) -> Result<()> {
    let Some(ring) = job.gpu_ring.as_mut() else {
        if orderly && job.world > 1 {
            return job.job.barrier(deadline).map_err(Error::from);
        }
        return Ok(());
    };
    let result = close_gpu_rings(&mut [ring], &job.job, deadline);
    job.gpu_ring = None;
    result
}

/// A joining deadline that passed is a [`Error::Timeout`] (what was awaited, how long), not
/// the transport failure the bootstrap's timeout arrives as.
fn joining_timeout(e: Error) -> Error {
    match &e {
        Error::Transport { source } => match source.get() {
            nodetour_core::Error::Timeout { what, after } => Error::Timeout {
                waiting_for: format!("the job to form: {what}"),
                rank: None,
                after: *after,
            },
            _ => e,
        },
        _ => e,
    }
}

impl Drop for Engine {
    /// Leaves at once: a collective still queued on a GPU stream is aborted (its neighbours are
    /// told), and the GPU ring's exported memory waits for the teardown handshake (to
    /// 10 s, then leaked). Ranks still in a collective with
    /// this one fail naming it. [`Communicator::close`] is the orderly way.
    fn drop(&mut self) {
        let job = self.state.get_mut().ok().and_then(|s| s.job.take());
        if let Some(mut job) = job {
            let deadline = Deadline::after(crate::gpu_ring::TEARDOWN_DEADLINE);
            if let Err(e) = teardown(&mut job, deadline, false) {
                tracing::warn!(error = %e, "dropping the communicator");
            }
        }
    }
}

impl Engine {
    /// Forms the engine of rank `launch.rank`'s job (every rank calls it, see
    /// [`Communicator::from_unique_id`]).
    pub(super) fn form(launch: Launch, options: &Options) -> Result<Engine> {
        if launch.world == 0 || launch.rank >= launch.world {
            return Err(Error::InvalidArgument {
                reason: format!("rank {} of {}", launch.rank, launch.world),
            });
        }
        let pin = match options.gpu {
            Some(ordinal) => Some(
                nodetour_core::cuda::open_context(ordinal)
                    .map_err(|e| Error::gpu(format!("opening GPU {ordinal}"), e))?,
            ),
            None => None,
        };
        let job = HostJob::form(launch, options, pin.as_ref()).map_err(joining_timeout)?;
        Ok(Engine::of_job(job, options.config.timeout))
    }

    /// Waits until every device collective queued on this engine has finished (and first
    /// `stream`, where one is given), to `deadline`: the GPU ring's watch of its neighbours,
    /// else the call-order stream. A failure breaks the engine.
    pub(super) fn wait_on(&self, stream: Option<&GpuStream>, deadline: Deadline) -> Result<()> {
        // Every device collective called so far ran on this engine's stream, in call order
        // (see `call_order`): a marker there covers every stream they were called on.
        let lane = self.call_order_mark()?;
        let mut state = self.lock()?;
        if let Some(first) = &state.failed {
            return Err(Error::Broken {
                first: Box::new(first.clone()),
            });
        }
        let Some(job) = state.job.as_mut().filter(|j| j.gpu_ring.is_some()) else {
            drop(state);
            return ringless(lane.as_ref(), stream, deadline);
        };
        let bootstrap = &job.job;
        let ring = job.gpu_ring.as_mut().expect("checked above");
        // The GPU ring names ranks by ring position; its errors name job ranks.
        let alive = || {
            bootstrap.check_present().map_err(|e| match e {
                nodetour_core::Error::RankLost { rank, reason } => nodetour_core::Error::RankLost {
                    rank: self.position_of(rank),
                    reason,
                },
                e => e,
            })
        };
        let result = ring
            .wait_streams(lane.as_ref(), stream, deadline.remaining(), &alive)
            .map_err(|e| self.job_ranks(e));
        if let Err(e) = &result {
            self.record_failure(&mut state, e);
        }
        result
    }

    /// [`Self::wait_on`] without a GPU ring of processes (a member of a GPU set): the
    /// call-order stream and `stream`.
    pub(super) fn wait_ringless(
        &self,
        stream: Option<&GpuStream>,
        deadline: Deadline,
    ) -> Result<()> {
        ringless(self.call_order_mark()?.as_ref(), stream, deadline)
    }

    /// Closes the engine once `finished` (its collectives' wait) is known: tears down its job,
    /// then returns the failure that broke it, else `finished` and the teardown's outcome.
    pub(super) fn close(&self, deadline: Deadline, finished: Result<()>) -> Result<()> {
        let mut state = self.lock()?;
        let job = state.job.take();
        let failed = state.failed.clone();
        drop(state);
        let Some(mut job) = job else {
            return finished;
        };
        let teardown = teardown(&mut job, deadline, failed.is_none());
        // Then the links, the regions, the device and the bootstrap (its drop stops the
        // liveness watcher, with a deadline), in the job's field order.
        drop(job);
        match failed {
            Some(first) => Err(Error::Broken {
                first: Box::new(first),
            }),
            None => finished.and(teardown),
        }
    }
}

/// Waits for the call-order stream's `lane` marker and for `stream`, to `deadline` (without a
/// GPU ring, the streams are waited for here; a GPU ring waits for them while it watches its
/// neighbours).
fn ringless(
    lane: Option<&nodetour_core::cuda::GpuEvent>,
    stream: Option<&GpuStream>,
    deadline: Deadline,
) -> Result<()> {
    if let Some(m) = lane {
        marker_done(m, deadline, "the communicator's device collectives")?;
    }
    stream.map_or(Ok(()), |s| stream_done(s, deadline))
}

impl Communicator {
    /// Forms the communicator of this process's job from the launcher's environment: rank,
    /// world size and rank 0's address from `NODETOUR_RANK`/`NODETOUR_WORLD_SIZE`/
    /// `NODETOUR_MASTER_ADDR`, torchrun, Open MPI or Slurm; the job token from
    /// `NODETOUR_JOB_TOKEN`. Without a token the job is unauthenticated, keyed by the
    /// launcher's job id (Slurm, Open MPI, torchrun's run id, `NODETOUR_JOB_ID`): a warning,
    /// and [`Self::paths`] says so; with neither, forming fails with an error that says how
    /// to set a token.
    pub fn from_env(options: Options) -> Result<Communicator> {
        let info = LaunchInfo::from_env()?;
        Self::form(
            Launch {
                rank: info.rank,
                world: info.world_size,
                rendezvous: info.rendezvous_addr(),
                token: nodetour_net::bootstrap::job_token(&info)?,
            },
            options,
        )
    }

    /// Forms the communicator of rank `rank` of `world` from an id that rank 0's process made
    /// with [`UniqueId::create`] (which binds rank 0's listener at once) and passed to every
    /// rank through the runtime's own store ([`UniqueId::encode`] / [`UniqueId::decode`]). The
    /// id carries the job token: publish it only where no one outside the job can read it.
    pub fn from_unique_id(
        id: &UniqueId,
        rank: u32,
        world: u32,
        options: Options,
    ) -> Result<Communicator> {
        Self::from_rendezvous(&id.address, rank, world, id.job_token(), options)
    }

    /// Forms the communicator of rank `rank` of `world` from rank 0's rendezvous address
    /// (which rank 0's process bound with [`nodetour_net::bootstrap::bind_rendezvous`] and
    /// published through the runtime's store) and the job token, which never travels through
    /// that store: [`nodetour_net::bootstrap::job_token_from`] takes `NODETOUR_JOB_TOKEN`, else
    /// an unauthenticated key named by the job (warned). For runtimes whose store others may
    /// read (torch.distributed's).
    pub fn from_rendezvous(
        address: &str,
        rank: u32,
        world: u32,
        token: nodetour_net::bootstrap::JobToken,
        options: Options,
    ) -> Result<Communicator> {
        Self::form(
            Launch {
                rank,
                world,
                rendezvous: address.to_owned(),
                token,
            },
            options,
        )
    }

    pub(super) fn form(launch: Launch, options: Options) -> Result<Communicator> {
        let formed_with =
            device_from_stream::FormedWith::new(&options, &launch.rendezvous, &launch.token);
        let engine = Engine::form(launch, &options)?;
        Ok(Communicator {
            device: Default::default(),
            engine,
            member: None,
            formed_with: Some(formed_with),
        })
    }

    /// Forms one communicator per entry of `contexts` (GPUs of this process, in ring order; a
    /// GPU may appear more than once), as NCCL's `ncclCommInitAll`: communicator `i` is rank
    /// `i` and runs device collectives on `contexts[i]`'s memory. Each GPU reads its ring
    /// neighbour's memory directly (peer access between neighbours on distinct GPUs is enabled
    /// here, and access to each GPU's current memory pool, where cudarc allocates, is granted
    /// to its neighbours; a pair without peer access is [`Error::Unsupported`]); nothing is
    /// staged through the host and no slot memory is held. Memory of another pool of the
    /// caller's needs the caller's own grant (see `nodetour_core::cuda`'s raw-handle contract).
    ///
    /// Drive them with one thread per GPU (each calls its communicator's device
    /// collective; every call returns once the collective is queued on every GPU's stream) or
    /// from one thread through a [`Group`] (as `ncclGroupStart`/`ncclGroupEnd`). Host-memory
    /// collectives are for communicators of processes; here they are
    /// [`Error::Unsupported`]. `options.config.timeout` bounds how long a call waits for the
    /// other GPUs' calls.
    pub fn from_devices(
        contexts: &[Arc<CudaContext>],
        options: Options,
    ) -> Result<Vec<Communicator>> {
        let set = DeviceSet::new(contexts, &options)?;
        let n = contexts.len() as u32;
        let reason = set.path();
        Ok((0..n)
            .map(|seat| {
                let paths = Paths {
                    rank: seat,
                    world: n,
                    order: (0..n).collect(),
                    links: Vec::new(),
                    security: "one process: no network".into(),
                    device: DevicePath::InProcess {
                        reason: reason.clone(),
                    },
                    peers: Vec::new(),
                };
                let timeout = options.config.timeout;
                Communicator {
                    device: Default::default(),
                    engine: Engine::of_set(seat, n, paths, timeout),
                    member: Some(SetMember::new(set.clone(), seat as usize, timeout)),
                    formed_with: None,
                }
            })
            .collect())
    }

    /// Waits until every collective issued so far has finished on this rank (device
    /// collectives run on their streams after the calls returned), to `deadline`, and returns
    /// the first failure if there was one; a failure breaks the communicator. Host collectives
    /// finish before they return. Replays of CUDA graphs are not calls: after launching one,
    /// use [`Self::wait_stream`].
    pub fn wait(&self, deadline: Deadline) -> Result<()> {
        self.wait_on(None, deadline)
    }

    /// [`Self::wait`], and first until `stream` has run everything queued on it so far: the
    /// replays of CUDA graphs that captured this communicator's collectives included, which
    /// the communicator does not see launched. Their outcome is what the GPU recorded (a wait
    /// inside the graph that timed out, a one-kernel collective that failed) and every
    /// neighbour's failure, which fails every replay not yet confirmed by a wait. Waiting on
    /// the stream in any other way (`cuStreamSynchronize`, an event) runs the replays but
    /// reports nothing: their results are trustworthy only after this returns `Ok`.
    ///
    /// `stream` is what the verbs take: the caller's cudarc stream (`&Arc<CudaStream>`) or a
    /// `&GpuStream`.
    pub fn wait_stream<Q: super::Queue>(&self, stream: Q, deadline: Deadline) -> Result<()> {
        let Some(s) = super::operand::sealed::Queue::stream(&stream) else {
            return Err(Error::InvalidArgument {
                reason: "wait_stream waits for a device stream (host collectives return when \
                         done)"
                    .into(),
            });
        };
        self.wait_on(Some(&s), deadline)
    }

    /// [`Self::wait`], after `stream` where one is given ([`Self::wait_stream`]).
    pub(super) fn wait_on(&self, stream: Option<&GpuStream>, deadline: Deadline) -> Result<()> {
        if let Some(d) = self.device.engine() {
            d.wait_on(stream, deadline)?;
        }
        if let Some(m) = &self.member {
            self.engine.wait_ringless(stream, deadline)?;
            return m.set.wait(deadline.remaining());
        }
        self.engine.wait_on(stream, deadline)
    }

    /// Closes the communicator: finishes the device collectives in flight (to `deadline`),
    /// waits until every rank has finished its collectives (a barrier over the bootstrap), then
    /// tears down links and memory; memory a neighbour maps (the GPU ring's slots) is freed only
    /// after every neighbour said it unmapped it, and leaked past the deadline rather than
    /// freed under a mapping. A broken communicator tears down at once and returns its failure.
    pub fn close(mut self, deadline: Deadline) -> Result<()> {
        // The device side formed from a stream closes first (every rank has one, or none).
        let device = self.device.take().map(|d| {
            let finished = d.wait_on(None, deadline);
            d.close(deadline, finished)
        });
        let finished = self.wait(deadline).and(device.unwrap_or(Ok(())));
        self.engine.close(deadline, finished)
    }
}

/// Ends GPU rings with the teardown handshake: each ring's streams drained and its mappings of
/// the neighbours' memory closed, then a barrier over `job` (or the liveness mesh reporting a
/// rank gone, which counts as closed) says every rank has done the same, and only then is the
/// memory this rank exported freed; past `deadline` it is leaked, never freed under a
/// neighbour's mapping. Every rank of the job calls it.
pub(crate) fn close_gpu_rings(
    rings: &mut [&mut crate::gpu_ring::GpuRing],
    job: &nodetour_net::bootstrap::Bootstrap,
    deadline: Deadline,
) -> Result<()> {
    let mut first = None;
    for ring in rings.iter_mut() {
        first = first.or(ring.close_imports(deadline.remaining()).err());
    }
    let handshake = job.barrier(deadline);
    // Without the handshake (a rank is lost, or late past the deadline), each ring frees what
    // it exported only once every neighbour that maps it confirmed its close or is gone (its
    // mappings went with it); a live neighbour that did not confirm may still map it, or write
    // it with credit it already holds: leaked, never freed under it.
    let mut leaked = false;
    for ring in rings.iter_mut() {
        if handshake.is_ok() || ring.neighbours_closed(&|r| job.is_absent(r)) {
            if handshake.is_err() {
                tracing::info!("teardown: every neighbour confirmed its close or is gone: freed");
            }
            first = first.or(ring.close(deadline.remaining()).err());
        } else {
            ring.leak_exports();
            leaked = true;
        }
    }
    match (first, handshake) {
        (Some(e), _) => Err(e),
        (None, Err(e)) if leaked => {
            tracing::error!(error = %e, "the teardown handshake failed: exported slots leaked");
            Err(Error::from(e))
        }
        _ => Ok(()),
    }
}
