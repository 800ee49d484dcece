//! Landing a chunk on the receiving side: read inline bytes straight into the destination slabs,
//! post the data path's tagged receives on them, or (one-sided puts) find them already there;
//! then verify. A chunk of a transfer that is ending is consumed into scratch memory, never into
//! its blocks.

use std::sync::Arc;

use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

use super::server::{End, Landing, LandingDone, ServerConn};
use crate::datapath::Completion;
use crate::error::TransferError;
use crate::inbound::InboundSession;
use crate::wire::{DataMode, Done, FrameReader, Msg};

impl ServerConn {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn chunk(
        &mut self,
        reader: &mut FrameReader<OwnedReadHalf>,
        id: u64,
        layer_start: u32,
        layer_end: u32,
        payload_bytes: u64,
        checksums: Vec<u64>,
    ) -> Result<(), End> {
        let mode = self.mode.unwrap_or(DataMode::Inline);
        let live = self.sessions.get_mut(&id).filter(|a| !a.session.aborting());
        let Some(active) = live else {
            // Ended or aborting: consume its bytes so the stream (or data path) stays in step.
            return self
                .discard(reader, id, mode, layer_start, layer_end, payload_bytes)
                .await;
        };
        if let Err(e) =
            active
                .session
                .check_chunk(layer_start, layer_end, checksums.len(), payload_bytes)
        {
            return Err(End::Protocol(e));
        }
        match mode {
            DataMode::Inline => {
                let read = read_inline(reader.stream(), &active.session, layer_start, layer_end);
                let r = tokio::select! {
                    r = read => r,
                    _ = self.kill.cancelled() => Err(std::io::ErrorKind::ConnectionAborted.into()),
                };
                r.map_err(|e| End::Gone(e.kind()))?;
                self.hash_landed(id, layer_start, layer_end, checksums);
                Ok(())
            }
            DataMode::Rma => {
                self.hash_landed(id, layer_start, layer_end, checksums);
                Ok(())
            }
            DataMode::Tag => {
                let done = self.post_tag_recvs(id, layer_start, layer_end, false)?;
                self.landing.push_back(Landing {
                    transfer_id: id,
                    layer_start,
                    layer_end,
                    checksums,
                    discard: false,
                    done: LandingDone::Received(done),
                });
                Ok(())
            }
        }
    }

    async fn discard(
        &mut self,
        reader: &mut FrameReader<OwnedReadHalf>,
        id: u64,
        mode: DataMode,
        layer_start: u32,
        layer_end: u32,
        payload_bytes: u64,
    ) -> Result<(), End> {
        match mode {
            DataMode::Inline => {
                self.scratch.resize(64 << 10, 0);
                let mut left = payload_bytes;
                while left > 0 {
                    let n = left.min(self.scratch.len() as u64) as usize;
                    let r = tokio::select! {
                        r = reader.stream().read_exact(&mut self.scratch[..n]) => r,
                        _ = self.kill.cancelled() => Err(std::io::ErrorKind::ConnectionAborted.into()),
                    };
                    r.map_err(|e| End::Gone(e.kind()))?;
                    left -= n as u64;
                }
                Ok(())
            }
            DataMode::Rma => Ok(()),
            DataMode::Tag => {
                if self.sessions.contains_key(&id) {
                    let done = self.post_tag_recvs(id, layer_start, layer_end, true)?;
                    self.landing.push_back(Landing {
                        transfer_id: id,
                        layer_start,
                        layer_end,
                        checksums: Vec::new(),
                        discard: true,
                        done: LandingDone::Received(done),
                    });
                }
                // A transfer that already ended sends no more tagged data: its sender fenced.
                Ok(())
            }
        }
    }

    /// Posts receives on the data path for one chunk's destination ranges (tag mode), numbered
    /// on from the transfer's `tag_index` in payload order, as the sender numbers its sends.
    /// With `discard` (a transfer being drained) they land in a throwaway buffer, never in the
    /// transfer's blocks.
    fn post_tag_recvs(
        &mut self,
        id: u64,
        layer_start: u32,
        layer_end: u32,
        discard: bool,
    ) -> Result<Completion, End> {
        let path = self
            .net
            .data_path()
            .ok_or_else(|| End::Protocol(TransferError::protocol("tag", "no data path")))?;
        let active = self.sessions.get_mut(&id).expect("caller checked");
        let pool = Arc::clone(active.session.pool());
        let first_range = active.tag_index;
        let mut ranges = Vec::new();
        for layer in layer_start..layer_end {
            for run in active.session.runs() {
                let (off, len) = active.session.dst_run_range(layer, run);
                let ptr = pool.range_ptr(off, len).map_err(End::Protocol)?;
                active.tag_index += 1;
                ranges.push((ptr as usize, len));
            }
        }
        if !discard {
            return Ok(path.post_recvs(self.conn_id, id, first_range, ranges, Box::new(pool)));
        }
        // Draining an aborted transfer: receive into a throwaway buffer, never into its blocks.
        let mut sink = vec![0u8; ranges.iter().map(|&(_, len)| len).max().unwrap_or(0)];
        for range in &mut ranges {
            range.0 = sink.as_mut_ptr() as usize;
        }
        Ok(path.post_recvs(self.conn_id, id, first_range, ranges, Box::new(sink)))
    }

    /// Queues hashing of a chunk whose bytes have landed (off this task; see [`LandingDone`]).
    fn hash_landed(&mut self, id: u64, layer_start: u32, layer_end: u32, checksums: Vec<u64>) {
        let active = self.sessions.get(&id).expect("caller checked");
        let job = match (&self.landing_device, self.mode) {
            // CUDA IPC: the bytes are in the device pool; hash them there.
            (Some(device), Some(DataMode::Rma)) => {
                let device = Arc::clone(device);
                let (offsets, slab) = active.session.dst_slab_offsets(layer_start, layer_end);
                tokio::task::spawn_blocking(move || device.hash_slabs(&offsets, slab))
            }
            _ => tokio::task::spawn_blocking(active.session.hasher(layer_start, layer_end)),
        };
        self.landing.push_back(Landing {
            transfer_id: id,
            layer_start,
            layer_end,
            checksums,
            discard: false,
            done: LandingDone::Hashed(job),
        });
    }

    pub(super) async fn landed(
        &mut self,
        l: Landing,
        result: Result<Option<Vec<u64>>, TransferError>,
    ) {
        if l.discard {
            return;
        }
        match result {
            Ok(actual) => {
                if let Err(End::Gone(_) | End::Protocol(_)) = self
                    .verify(
                        l.transfer_id,
                        l.layer_start,
                        l.layer_end,
                        &l.checksums,
                        actual,
                    )
                    .await
                {
                    self.kill.cancel();
                }
            }
            Err(e) => {
                if let Some(a) = self.sessions.get(&l.transfer_id) {
                    a.session.abort(e);
                }
            }
        }
    }

    /// Verifies landed layers (hashing them here unless `actual` has their checksums);
    /// completes the session or asks its writer to abort.
    async fn verify(
        &mut self,
        id: u64,
        layer_start: u32,
        layer_end: u32,
        checksums: &[u64],
        actual: Option<Vec<u64>>,
    ) -> Result<(), End> {
        let Some(active) = self.sessions.get_mut(&id) else {
            return Ok(());
        };
        let verdict = match actual {
            Some(actual) => active
                .session
                .accept_chunk(layer_start, layer_end, &actual, checksums),
            None => active
                .session
                .verify_chunk(layer_start, layer_end, checksums),
        };
        match verdict {
            Ok(false) => Ok(()),
            Ok(true) => {
                let active = self.sessions.remove(&id).expect("present");
                let block_checksums = active.session.block_checksums();
                if active.session.finish(Ok(())) {
                    self.reply(Msg::Done(Done {
                        transfer_id: id,
                        block_checksums,
                    }))
                    .await?;
                }
                Ok(())
            }
            Err(e) => {
                tracing::warn!(peer = self.peer, error = %e, "chunk failed verification; aborting transfer");
                active.session.abort(e);
                Ok(())
            }
        }
    }
}

/// Reads one chunk's inline payload straight into the destination slabs, in payload order.
async fn read_inline(
    stream: &mut OwnedReadHalf,
    session: &InboundSession,
    layer_start: u32,
    layer_end: u32,
) -> std::io::Result<()> {
    let pool = Arc::clone(session.pool());
    for layer in layer_start..layer_end {
        for run in session.runs() {
            let (off, len) = session.dst_run_range(layer, run);
            let ptr = pool
                .range_ptr(off, len)
                .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
            // SAFETY: in bounds (range_ptr); these slabs belong to the reservation this session
            // claimed, which nobody else reads or writes until the session finishes.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            stream.read_exact(dst).await?;
        }
    }
    Ok(())
}
