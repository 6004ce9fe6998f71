//! The device from the caller: a communicator formed without a GPU ([`Options::gpu`] unset)
//! forms its device side on the GPU of the first device collective's stream, so a runtime
//! never names the GPU twice and device memory is never staged through the host for want of
//! one.
//!
//! That first device collective is a collective of its own, on every rank: rank 0 makes a
//! fresh job id (a new rendezvous and a random token) and broadcasts it over the host ring
//! (authenticated; a rank doing anything else there fails with `Disagreement`, on every rank),
//! then every rank forms a communicator of the same ranks with that id and its stream's GPU,
//! through the whole formation (GPU ring, one-kernel path, or staged with the reason, logged
//! and in [`Communicator::paths`]). Device collectives run on it from then on; host
//! collectives stay on the first. It cannot be captured into a CUDA graph (forming waits for
//! peers): under capture it is refused, typed, before anything is sent.

use std::sync::OnceLock;

use super::*;

/// Bytes of the broadcast that carries the device job's id (its text form is ~60 bytes).
const ID_BYTES: usize = 256;

/// What a communicator of processes keeps to form its device side later.
pub(super) struct FormedWith {
    pub(super) options: Options,
    /// Rank 0's rendezvous host, where the device job's rendezvous listens too.
    pub(super) host: Option<String>,
}

/// The device side formed from a stream ([`Communicator::on_device`]).
#[derive(Default)]
pub(super) struct DeviceSide {
    pub(super) comm: OnceLock<Box<Communicator>>,
    /// Serialises the formation (two threads' first device collectives).
    pub(super) forming: Mutex<()>,
    /// Its abort handle, shared with every [`AbortHandle`] of the first communicator.
    pub(super) abort: Arc<OnceLock<AbortHandle>>,
}

impl FormedWith {
    pub(super) fn new(options: &Options, rendezvous: &str) -> FormedWith {
        FormedWith {
            options: options.clone(),
            host: rendezvous.rsplit_once(':').map(|(h, _)| h.to_owned()),
        }
    }
}

impl Communicator {
    /// The communicator whose device collectives run on `stream`'s GPU: this one where it was
    /// formed with that GPU, the device side formed from a stream before, or one formed now.
    pub(super) fn on_device(&self, stream: &GpuStream) -> Result<&Communicator> {
        let gpu = stream.context().ordinal();
        let other_gpu = |formed: usize, how: &str| Error::InvalidArgument {
            reason: format!(
                "this communicator runs device collectives on GPU {formed} ({how}); the stream \
                 is on GPU {gpu}"
            ),
        };
        let Some(formed_with) = &self.formed_with else {
            return Ok(self);
        };
        if let Some(g) = formed_with.options.gpu {
            return if g == gpu {
                Ok(self)
            } else {
                Err(other_gpu(g, "Options::gpu"))
            };
        }
        let formed = |d: &Communicator| match d.formed_with.as_ref().and_then(|f| f.options.gpu) {
            Some(g) if g != gpu => Err(other_gpu(g, "its first device collective's stream")),
            _ => Ok(()),
        };
        if let Some(d) = self.device.comm.get() {
            formed(d)?;
            return Ok(d);
        }
        let _one = self.device.forming.lock().map_err(|_| poisoned())?;
        if let Some(d) = self.device.comm.get() {
            formed(d)?;
            return Ok(d);
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
        let _ = self.device.abort.set(device.abort_handle());
        let _ = self.device.comm.set(Box::new(device));
        Ok(self.device.comm.get().expect("just set"))
    }

    /// Forms the device side on GPU `gpu`: the job id broadcast from rank 0, then the
    /// communicator of the same ranks on that id and GPU.
    fn form_device(&self, formed_with: &FormedWith, gpu: usize) -> Result<Communicator> {
        let mut id = [0u8; ID_BYTES];
        if self.rank == 0 {
            let mut made = UniqueId::create()?;
            if let (Some(host), Some((_, port))) =
                (&formed_with.host, made.address.rsplit_once(':'))
            {
                made.address = format!("{host}:{port}");
            }
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
            ..self.descriptor(
                Collective::Broadcast,
                ID_BYTES,
                DataType::U8,
                ReduceOp::Sum,
                Some(0),
            )
        };
        self.broadcast_as(what, &mut id, 0)?;
        let end = id.iter().position(|b| *b == 0).unwrap_or(ID_BYTES);
        let text = std::str::from_utf8(&id[..end]).map_err(|_| Error::Protocol {
            rank: 0,
            reason: "the device job's id is not text".into(),
        })?;
        let id = UniqueId::decode(text)?;
        let options = formed_with.options.clone().with_gpu(gpu);
        let device = Communicator::from_unique_id(&id, self.rank, self.world, options)?;
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

    /// A rank forming its device side while another runs a host broadcast of the same shape
    /// (256 bytes from rank 0): the formation's own algorithm makes them differ, so every rank
    /// fails typed (the disagreement, or the notice of it) at once, and none takes the other's
    /// bytes for a job id or for its broadcast.
    #[test]
    fn a_formation_beside_a_host_collective_is_a_disagreement_on_every_rank() {
        let id = UniqueId::create().unwrap();
        let options = Options::default()
            .with_transport(TransportKind::Tcp)
            .with_timeout(Duration::from_secs(20));
        let got: Vec<Result<()>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u32)
                .map(|r| {
                    let (id, options) = (&id, options.clone());
                    s.spawn(move || {
                        let comm = Communicator::from_unique_id(id, r, 2, options).unwrap();
                        let mut bytes = [7u8; ID_BYTES];
                        let t = std::time::Instant::now();
                        let result = if r == 0 {
                            let what = Descriptor {
                                algorithm: Algorithm::DeviceFormation,
                                ..comm.descriptor(
                                    Collective::Broadcast,
                                    ID_BYTES,
                                    DataType::U8,
                                    ReduceOp::Sum,
                                    Some(0),
                                )
                            };
                            comm.broadcast_as(what, &mut bytes, 0)
                        } else {
                            comm.broadcast_in_place(&mut bytes, 0, Host)
                        };
                        assert!(t.elapsed() < Duration::from_secs(15), "it waited: {result:?}");
                        assert!(r == 0 || bytes == [7u8; ID_BYTES], "rank 1 took bytes");
                        result
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
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
            got.iter().any(|r| matches!(r, Err(Error::Disagreement { .. }))),
            "{got:?}"
        );
    }
}
