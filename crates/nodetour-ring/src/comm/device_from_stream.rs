//! The device from the caller: a communicator formed without a GPU ([`Options::gpu`] unset)
//! forms its device side on the GPU of the first device collective's stream, so a runtime
//! never names the GPU twice and device memory is never staged through the host for want of
//! one.
//!
//! That first device collective is a collective of its own, on every rank: rank 0 binds a
//! fresh rendezvous and broadcasts its address with a fresh nonce over the host ring
//! (authenticated; a rank doing anything else there fails with `Disagreement`, on every rank);
//! every rank derives the device job's token from the job's own and the nonce, so no secret
//! travels; then every rank forms an engine of the same ranks with that id and its stream's
//! GPU (`engine.rs`: a job beside the communicator's own, not a communicator inside it),
//! through the whole formation (GPU ring, one-kernel path, or staged with the reason, logged
//! and in [`Communicator::paths`]). With a GPU ring, device collectives queue on it from then
//! on; staged (ranks on several hosts), they run on the communicator's own host ring, in one
//! order with the host collectives (its host memory is not registered with that GPU, as it is
//! under `Options::with_gpu`: copies through pageable memory, slower at large sizes). It
//! cannot be captured into a CUDA graph (forming waits for peers): under capture it is
//! refused, typed, before anything is sent.

use std::sync::OnceLock;

use super::*;

/// Bytes of the broadcast that carries the device job's id (its text form is ~60 bytes).
const ID_BYTES: usize = 256;

/// What a communicator of processes keeps to form its device side later.
pub(super) struct FormedWith {
    pub(super) options: Options,
    /// Rank 0's rendezvous host, where the device job's rendezvous listens too.
    pub(super) host: Option<String>,
    /// The job's token, from which the device job's is derived on every rank.
    token: nodetour_net::bootstrap::JobToken,
}

/// The device side formed from a stream ([`Communicator::on_device`]).
#[derive(Default)]
pub(super) struct DeviceSide {
    /// Its GPU and its engine, where it has a GPU ring (device collectives queue there): an
    /// engine beside the communicator's own, sharing its count of calls.
    engine: OnceLock<(usize, Box<Engine>)>,
    /// Where its formation chose to stage (ranks on several hosts): that GPU and the path with
    /// its reason. Device collectives then run staged on the communicator's own engine (its
    /// host ring), beside its host collectives, so the two kinds share one order and one
    /// agreement check; the device side's engine was closed.
    pub(super) staged: OnceLock<(usize, DevicePath)>,
    /// Serialises the formation (two threads' first device collectives).
    pub(super) forming: Mutex<()>,
}

impl DeviceSide {
    /// Its engine, once formed with a GPU ring.
    pub(super) fn engine(&self) -> Option<&Engine> {
        self.engine.get().map(|(_, e)| &**e)
    }

    /// Its engine, taken (to close it).
    pub(super) fn take(&mut self) -> Option<Box<Engine>> {
        self.engine.take().map(|(_, e)| e)
    }
}

impl FormedWith {
    pub(super) fn new(
        options: &Options,
        rendezvous: &str,
        token: &nodetour_net::bootstrap::JobToken,
    ) -> FormedWith {
        FormedWith {
            options: options.clone(),
            host: rendezvous.rsplit_once(':').map(|(h, _)| h.to_owned()),
            token: token.clone(),
        }
    }

    /// The device job's id from what rank 0 broadcast (its rendezvous and a nonce, in
    /// [`UniqueId`]'s text form with the nonce in the token's place): the token derived from
    /// the job's own and the nonce, on every rank alike.
    fn device_id(&self, sent: &UniqueId) -> UniqueId {
        let mut label = b"nodetour device side ".to_vec();
        label.extend_from_slice(&sent.token);
        UniqueId {
            address: sent.address.clone(),
            token: self.token.derive(&label),
        }
    }
}

impl Communicator {
    /// The engine whose device collectives run on `stream`'s GPU: this communicator's own
    /// where it was formed with that GPU, the device side formed from a stream before, or one
    /// formed now.
    pub(super) fn on_device(&self, stream: &GpuStream) -> Result<&Engine> {
        let gpu = stream.context().ordinal();
        let other_gpu = |formed: usize, how: &str| Error::InvalidArgument {
            reason: format!(
                "this communicator runs device collectives on GPU {formed} ({how}); the stream \
                 is on GPU {gpu}"
            ),
        };
        let Some(formed_with) = &self.formed_with else {
            return Ok(&self.engine);
        };
        if let Some(g) = formed_with.options.gpu {
            return if g == gpu {
                Ok(&self.engine)
            } else {
                Err(other_gpu(g, "Options::gpu"))
            };
        }
        let ready = || -> Result<Option<&Engine>> {
            let formed = self.device.engine.get().map(|(g, e)| (*g, &**e));
            let staged = self.device.staged.get().map(|(g, _)| (*g, &self.engine));
            match formed.or(staged) {
                Some((g, _)) if g != gpu => {
                    Err(other_gpu(g, "its first device collective's stream"))
                }
                Some((_, engine)) => Ok(Some(engine)),
                None => Ok(None),
            }
        };
        if let Some(e) = ready()? {
            return Ok(e);
        }
        let _one = self.device.forming.lock().map_err(|_| poisoned())?;
        if let Some(e) = ready()? {
            return Ok(e);
        }
        if stream.is_capturing().map_err(gpu_error)? {
            return Err(Error::Unsupported {
                reason: format!(
                    "the first device collective of a communicator formed without a GPU forms \
                     its device side on GPU {gpu}, which waits for every rank and cannot be \
                     captured into a CUDA graph: run one device collective before capturing, \
                     or form with Options::with_gpu({gpu})"
                ),
            });
        }
        let device = self.form_device(formed_with, gpu)?;
        if !matches!(device.paths.device, DevicePath::GpuRing { .. }) {
            // Staged (the same choice on every rank): on this communicator's host ring.
            let _ = self.device.staged.set((gpu, device.paths.device.clone()));
            let deadline = Deadline::after(formed_with.options.join_timeout());
            let finished = device.wait_on(None, deadline);
            device.close(deadline, finished)?;
            return Ok(&self.engine);
        }
        let _ = self.engine.device_abort.set(device.abort_handle());
        let _ = self.device.engine.set((gpu, Box::new(device)));
        Ok(self.device.engine().expect("just set"))
    }

    /// Forms the device side on GPU `gpu`: the job id broadcast from rank 0, then the engine
    /// of the same ranks on that id and GPU.
    fn form_device(&self, formed_with: &FormedWith, gpu: usize) -> Result<Engine> {
        let mut id = [0u8; ID_BYTES];
        if self.rank() == 0 {
            // What travels: the rendezvous and a fresh nonce (in the token's place), no secret.
            let mut made = UniqueId::create()?;
            if let (Some(host), Some((_, port))) =
                (&formed_with.host, made.address.rsplit_once(':'))
            {
                made.address = format!("{host}:{port}");
            }
            made.token
                .copy_from_slice(&nodetour_core::auth::nonce()[..16]);
            let text = made.encode();
            let room = id
                .get_mut(..text.len())
                .ok_or_else(|| Error::InvalidArgument {
                    reason: format!("a job id of {} bytes (at most {ID_BYTES})", text.len()),
                })?;
            room.copy_from_slice(text.as_bytes());
        }
        let what = Descriptor {
            algorithm: Algorithm::DeviceFormation,
            ..self.engine.descriptor(
                Collective::Broadcast,
                ID_BYTES,
                DataType::U8,
                ReduceOp::Sum,
                Some(0),
            )
        };
        self.engine.broadcast_as(what, &mut id, 0)?;
        let end = id.iter().position(|b| *b == 0).unwrap_or(ID_BYTES);
        let text = std::str::from_utf8(&id[..end]).map_err(|_| Error::Protocol {
            rank: 0,
            reason: "the device job's id is not text".into(),
        })?;
        let id = formed_with.device_id(&UniqueId::decode(text)?);
        let options = formed_with.options.clone().with_gpu(gpu);
        let launch = Launch {
            rank: self.rank(),
            world: self.world(),
            rendezvous: id.address.clone(),
            token: id.job_token(),
        };
        let mut device = Engine::form(launch, &options)?;
        // One count of collectives for both: host and device collectives interleaved
        // differently on two ranks carry different numbers, and disagree.
        device.calls = self.engine.calls.clone();
        tracing::info!(
            gpu,
            paths = %device.paths,
            "device collectives formed on the first device collective's GPU"
        );
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nodetour_core::transport::TransportKind;

    use super::*;

    /// `body(rank, communicator)` on two ranks (threads over tcp); what each returned.
    fn two_ranks<R: Send>(body: impl Fn(u32, &Communicator) -> R + Sync) -> Vec<R> {
        let id = UniqueId::create().unwrap();
        let options = Options::default()
            .with_transport(TransportKind::Tcp)
            .with_timeout(Duration::from_secs(20));
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u32)
                .map(|r| {
                    let (id, options, body) = (&id, options.clone(), &body);
                    s.spawn(move || {
                        let comm = Communicator::from_unique_id(id, r, 2, options).unwrap();
                        let t = std::time::Instant::now();
                        let got = body(r, &comm);
                        assert!(t.elapsed() < Duration::from_secs(15), "rank {r} waited");
                        got
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The device job's id: what rank 0 broadcasts is its rendezvous and a nonce; the token
    /// every rank derives from the job's token and that nonce never travels, differs with the
    /// nonce and with the job, and is the same on every rank.
    #[test]
    fn the_device_jobs_token_is_derived_on_every_rank_and_never_sent() {
        let job = nodetour_net::bootstrap::JobToken::new(b"a job's secret".to_vec());
        let formed = FormedWith::new(&Options::default(), "10.0.0.1:29500", &job);
        let sent = UniqueId::new("10.0.0.1:40000");
        let wire = sent.encode();
        let id = formed.device_id(&UniqueId::decode(&wire).unwrap());
        let hex: String = id.token.iter().map(|b| format!("{b:02x}")).collect();
        assert!(!wire.contains(&hex), "the derived token is on the wire");
        assert_ne!(id.token, sent.token);
        assert_eq!(id.address, "10.0.0.1:40000");
        let again = FormedWith::new(&Options::default(), "10.0.0.1:29500", &job.clone());
        assert_eq!(
            again.device_id(&sent).token,
            id.token,
            "every rank derives the same"
        );
        let other_nonce = UniqueId::new("10.0.0.1:40000");
        assert_ne!(formed.device_id(&other_nonce).token, id.token);
        let other_job = nodetour_net::bootstrap::JobToken::new(b"another job".to_vec());
        let other = FormedWith::new(&Options::default(), "10.0.0.1:29500", &other_job);
        assert_ne!(other.device_id(&sent).token, id.token);
    }

    fn typed_on_every_rank(got: &[Result<()>]) {
        for (r, result) in got.iter().enumerate() {
            assert!(
                matches!(
                    result,
                    Err(Error::Disagreement { .. } | Error::PeerFailed { .. })
                ),
                "rank {r}: {result:?}"
            );
        }
        assert!(
            got.iter()
                .any(|r| matches!(r, Err(Error::Disagreement { .. }))),
            "{got:?}"
        );
    }

    /// A rank forming its device side while another runs a host broadcast of the same shape
    /// (256 bytes from rank 0): the formation's own algorithm makes them differ, so every rank
    /// fails typed (the disagreement, or the notice of it) at once, and none takes the other's
    /// bytes for a job id or for its broadcast.
    #[test]
    fn a_formation_beside_a_host_collective_is_a_disagreement_on_every_rank() {
        let got = two_ranks(|r, comm| {
            let mut bytes = [7u8; ID_BYTES];
            let result = if r == 0 {
                let what = Descriptor {
                    algorithm: Algorithm::DeviceFormation,
                    ..comm.engine.descriptor(
                        Collective::Broadcast,
                        ID_BYTES,
                        DataType::U8,
                        ReduceOp::Sum,
                        Some(0),
                    )
                };
                comm.engine.broadcast_as(what, &mut bytes, 0)
            } else {
                comm.broadcast_in_place(&mut bytes, 0, Host)
            };
            assert!(r == 0 || bytes == [7u8; ID_BYTES], "rank 1 took bytes");
            result
        });
        typed_on_every_rank(&got);
    }

    /// The descriptor's tag is 15 bits, so two different collectives can share one: found
    /// here by brute force (two broadcasts of different lengths, the first collective of the
    /// communicator). Their disagreement still fails typed on every rank, and neither takes
    /// the other's bytes: the first grant of a collective carries the whole descriptor, which
    /// is compared in full, not by its tag.
    #[test]
    fn descriptors_with_equal_tags_still_disagree_on_every_rank() {
        let broadcast = |count: u64| Descriptor {
            collective: Collective::Broadcast,
            count,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            root: Some(0),
            algorithm: Algorithm::HostRing,
            seq: 0,
            call: 0,
        };
        let a = broadcast(4096);
        let b = (4097..1_000_000u64)
            .map(broadcast)
            .find(|d| d.tag() == a.tag())
            .expect("a 15-bit tag collides within a million lengths");
        assert_ne!(a, b);
        let got = two_ranks(|r, comm| {
            let what = if r == 0 { a } else { b };
            let mut bytes = vec![7u8 + r as u8; what.count as usize];
            let result = comm.engine.broadcast_as(what, &mut bytes, 0);
            assert!(
                r == 0 || bytes.iter().all(|x| *x == 8),
                "rank 1 took rank 0's bytes"
            );
            result
        });
        typed_on_every_rank(&got);
    }

    /// Host and device collectives interleaved differently: rank 1 ran a device collective
    /// (queued on its GPU ring, which takes the communicator's next number, modelled here by
    /// taking it) before the host allreduce that rank 0 runs first. The host allreduces carry
    /// different numbers: a disagreement on every rank, not a wait, and no `Ok`. In the same
    /// order, every collective is right.
    #[test]
    fn host_and_device_collectives_interleaved_differently_disagree_on_every_rank() {
        let got = two_ranks(|r, comm| {
            if r == 1 {
                comm.engine.next_call();
            }
            let mut x = [1i64 + i64::from(r); 64];
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
        });
        typed_on_every_rank(&got);
        let got = two_ranks(|_, comm| -> Result<()> {
            for i in 0..4i64 {
                comm.engine.next_call(); // a device collective, on every rank alike
                // Seeded by the collective's index and the rank: a stale answer cannot pass.
                let mut x = [3 * i + i64::from(comm.rank()); 64];
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)?;
                assert_eq!(x, [6 * i + 1; 64]);
            }
            Ok(())
        });
        assert!(got.iter().all(Result::is_ok), "{got:?}");
    }
}
