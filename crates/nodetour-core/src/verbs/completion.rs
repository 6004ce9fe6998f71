//! Work completions in Rust terms, and what each error status means.

use rdma_sys::ibv_wc;

use crate::error::Error;

/// Bit set in the work request ids of receives, so a completion (whose opcode is undefined
/// when it failed) can still be told apart from a send's.
pub(crate) const RECV_WR_BIT: u64 = 1 << 63;

/// A successful work completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// A signalled send-side work request (RDMA WRITE, WRITE_WITH_IMM, ...) completed; it and
    /// every unsignalled request posted before it are done.
    Send {
        /// Id of the signalled request.
        wr_id: u64,
        /// How many work requests (it and earlier unsignalled ones) this retired.
        retired: u32,
    },
    /// A peer's RDMA WRITE_WITH_IMM landed: the bytes it and the writes before it on the same
    /// queue pair carried are in place.
    WriteWithImmediate {
        /// Id of the receive it consumed.
        wr_id: u64,
        /// The immediate, in host byte order.
        immediate: u32,
        /// Bytes of the write that carried the immediate.
        byte_len: u32,
    },
}

/// What a raw completion is, before bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Raw {
    Send {
        wr_id: u64,
    },
    Recv {
        wr_id: u64,
        immediate: Option<u32>,
        byte_len: u32,
    },
}

const IBV_WC_WITH_IMM: u32 = 2;

/// Classifies a raw completion, or turns its error status into [`Error::WorkCompletion`].
/// The send/receive side is returned with the error so bookkeeping can still retire it.
pub(crate) fn classify(qpn: u32, wc: &ibv_wc) -> (Raw, Result<(), Error>) {
    let is_recv = wc.wr_id & RECV_WR_BIT != 0;
    let raw = if is_recv {
        let immediate = (wc.wc_flags & IBV_WC_WITH_IMM != 0)
            // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate.
            .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
        Raw::Recv {
            wr_id: wc.wr_id,
            immediate,
            byte_len: wc.byte_len,
        }
    } else {
        Raw::Send { wr_id: wc.wr_id }
    };
    let status = if wc.status == 0 {
        Ok(())
    } else {
        let (name, hint) = status_text(wc.status);
        Err(Error::WorkCompletion {
            qpn,
            wr_id: wc.wr_id & !RECV_WR_BIT,
            status: name,
            status_code: wc.status,
            vendor_err: wc.vendor_err,
            hint,
        })
    };
    (raw, status)
}

/// The verbs name of a work completion status and what it usually means.
pub fn status_text(status: u32) -> (&'static str, &'static str) {
    match status {
        0 => ("IBV_WC_SUCCESS", ""),
        1 => (
            "IBV_WC_LOC_LEN_ERR",
            "a local buffer is shorter than the data",
        ),
        2 => (
            "IBV_WC_LOC_QP_OP_ERR",
            "the queue pair could not execute the request (wrong state, or a bad route)",
        ),
        3 => ("IBV_WC_LOC_EEC_OP_ERR", ""),
        4 => (
            "IBV_WC_LOC_PROT_ERR",
            "a local key or range is wrong: the buffer is not (or no longer) registered",
        ),
        5 => (
            "IBV_WC_WR_FLUSH_ERR",
            "flushed: the queue pair was already in error (look for the first error)",
        ),
        6 => ("IBV_WC_MW_BIND_ERR", ""),
        7 => ("IBV_WC_BAD_RESP_ERR", "unexpected response from the peer"),
        8 => (
            "IBV_WC_LOC_ACCESS_ERR",
            "local access violation: the region lacks LOCAL_WRITE",
        ),
        9 => (
            "IBV_WC_REM_INV_REQ_ERR",
            "the peer refused the request as invalid (too long, or an operation it does not allow)",
        ),
        10 => (
            "IBV_WC_REM_ACCESS_ERR",
            "the peer refused the key or range: wrong rkey, out of its region, or the region lacks remote access",
        ),
        11 => (
            "IBV_WC_REM_OP_ERR",
            "the peer could not complete the operation",
        ),
        12 => (
            "IBV_WC_RETRY_EXC_ERR",
            "no acknowledgement from the peer after every retry: the peer is gone, the path is broken, or (GPU memory) ACS/IOMMU blocks peer-to-peer DMA",
        ),
        13 => (
            "IBV_WC_RNR_RETRY_EXC_ERR",
            "the peer had no receive posted for a WRITE_WITH_IMM after every retry",
        ),
        14 => ("IBV_WC_LOC_RDD_VIOL_ERR", ""),
        15 => ("IBV_WC_REM_INV_RD_REQ_ERR", ""),
        16 => ("IBV_WC_REM_ABORT_ERR", "the peer aborted the operation"),
        17 => ("IBV_WC_INV_EECN_ERR", ""),
        18 => ("IBV_WC_INV_EEC_STATE_ERR", ""),
        19 => ("IBV_WC_FATAL_ERR", "the device reported a fatal error"),
        20 => (
            "IBV_WC_RESP_TIMEOUT_ERR",
            "the peer did not respond in time",
        ),
        21 => (
            "IBV_WC_GENERAL_ERR",
            "the provider reported a general error",
        ),
        22 => ("IBV_WC_TM_ERR", ""),
        23 => ("IBV_WC_TM_RNDV_INCOMPLETE", ""),
        _ => ("IBV_WC_(unknown status)", ""),
    }
}

/// Whether `status` is the flush that follows the first error.
pub(crate) fn is_flush(status: u32) -> bool {
    status == 5
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wc(wr_id: u64, status: u32, flags: u32, imm_be: u32) -> ibv_wc {
        // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
        let mut w: ibv_wc = unsafe { std::mem::zeroed() };
        w.wr_id = wr_id;
        w.status = status;
        w.wc_flags = flags;
        w.byte_len = 64;
        w.imm_data_invalidated_rkey_union.imm_data = imm_be;
        w
    }

    #[test]
    fn successful_send_and_receive() {
        assert_eq!(classify(7, &wc(3, 0, 0, 0)).0, Raw::Send { wr_id: 3 });
        let (raw, status) = classify(
            7,
            &wc(RECV_WR_BIT | 9, 0, IBV_WC_WITH_IMM, 0xdeadbeef_u32.to_be()),
        );
        assert!(status.is_ok());
        assert_eq!(
            raw,
            Raw::Recv {
                wr_id: RECV_WR_BIT | 9,
                immediate: Some(0xdeadbeef),
                byte_len: 64
            }
        );
    }

    #[test]
    fn every_error_status_is_typed_with_its_name() {
        for status in 1..=23 {
            let (raw, result) = classify(5, &wc(RECV_WR_BIT | 2, status, 0, 0));
            assert!(matches!(raw, Raw::Recv { .. }), "side is kept on error");
            match result {
                Err(Error::WorkCompletion {
                    qpn: 5,
                    wr_id: 2,
                    status: name,
                    status_code,
                    ..
                }) => {
                    assert_eq!(status_code, status);
                    assert!(name.starts_with("IBV_WC_"), "{name}");
                }
                other => panic!("status {status}: {other:?}"),
            }
        }
        let (_, e) = classify(1, &wc(1, 12, 0, 0));
        assert!(e.unwrap_err().to_string().contains("ACS/IOMMU"));
        let (_, e) = classify(1, &wc(1, 99, 0, 0));
        assert!(e.is_err());
    }

    #[test]
    fn flush_is_recognised() {
        assert!(is_flush(5) && !is_flush(12));
    }
}
