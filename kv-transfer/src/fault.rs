//! Fault injection for tests and drills: drop, delay, corrupt a byte, cut the connection.
//!
//! Faults exist only when the crate is built with the `fault-injection` cargo feature, which no
//! default build enables: without it, [`Fault`] does not exist, so no config file, flag or
//! environment variable of a production build can turn one on. With it, a fault still applies
//! only to a push whose [`crate::PushRequest`] carries it explicitly.
//!
//! Faults act on the sender's data path, so they exercise the receiver's real checks:
//! - `DropChunk`: the chunk's bytes and descriptor are never sent; the transfer can only end by
//!   deadline, cancellation or reservation expiry;
//! - `DelayChunks`: sleep before each chunk (slow sender; with layer streaming, slow compute);
//! - `CorruptByte`: after checksumming, one payload byte is flipped on its way (a stream copy, a
//!   one-byte UCX put, or the in-process copy): the receiver must report `ChecksumMismatch`;
//! - `CutAfterBytes`: after that many payload bytes the connection is torn down mid-chunk: both
//!   sides must see `PeerGone` and release everything.

use std::time::Duration;

/// One fault for one push.
#[cfg(feature = "fault-injection")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Never send chunk number `index` (0-based).
    DropChunk {
        /// Which chunk.
        index: u32,
    },
    /// Sleep this long before each chunk.
    DelayChunks {
        /// The delay.
        delay: Duration,
    },
    /// Flip every bit of the payload byte at this offset (counted over the whole transfer).
    CorruptByte {
        /// Offset into the transfer's payload bytes.
        offset: u64,
    },
    /// Tear the connection down once this many payload bytes have been sent.
    CutAfterBytes {
        /// Bytes to let through first.
        bytes: u64,
    },
}

#[cfg(feature = "fault-injection")]
impl std::str::FromStr for Fault {
    type Err = String;

    /// Parses `drop:N`, `delay-ms:N`, `corrupt:OFFSET` or `cut:BYTES`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, value) = s
            .split_once(':')
            .ok_or_else(|| format!("fault `{s}`: expected NAME:VALUE"))?;
        let n: u64 = value.parse().map_err(|e| format!("fault `{s}`: {e}"))?;
        match name {
            "drop" => Ok(Fault::DropChunk { index: n as u32 }),
            "delay-ms" => Ok(Fault::DelayChunks {
                delay: Duration::from_millis(n),
            }),
            "corrupt" => Ok(Fault::CorruptByte { offset: n }),
            "cut" => Ok(Fault::CutAfterBytes { bytes: n }),
            _ => Err(format!(
                "fault `{s}`: unknown kind (drop, delay-ms, corrupt, cut)"
            )),
        }
    }
}

/// What the data path must do with one chunk, decided by [`ChunkFaults::for_chunk`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ChunkFaults {
    /// Skip the chunk entirely.
    pub drop: bool,
    /// Sleep before sending it.
    pub delay: Option<Duration>,
    /// Flip the byte at this offset *within the chunk's payload*.
    pub corrupt_at: Option<u64>,
    /// Send only this many bytes of the chunk's payload, then cut the connection.
    pub cut_at: Option<u64>,
}

/// The per-push fault state (a no-op without the feature).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FaultState {
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
}

impl FaultState {
    /// What to do with chunk `index`, whose payload starts at transfer offset `start` and is
    /// `len` bytes long.
    #[cfg_attr(not(feature = "fault-injection"), allow(unused_variables))]
    pub fn for_chunk(&self, index: u32, start: u64, len: u64) -> ChunkFaults {
        #[cfg(feature = "fault-injection")]
        if let Some(f) = self.fault {
            let within = |at: u64| (at >= start && at < start + len).then(|| at - start);
            return match f {
                Fault::DropChunk { index: i } => ChunkFaults {
                    drop: i == index,
                    ..Default::default()
                },
                Fault::DelayChunks { delay } => ChunkFaults {
                    delay: Some(delay),
                    ..Default::default()
                },
                Fault::CorruptByte { offset } => ChunkFaults {
                    corrupt_at: within(offset),
                    ..Default::default()
                },
                Fault::CutAfterBytes { bytes } => ChunkFaults {
                    cut_at: within(bytes),
                    ..Default::default()
                },
            };
        }
        ChunkFaults::default()
    }
}

#[cfg(all(test, feature = "fault-injection"))]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_and_land_only_in_the_chunk_that_holds_their_offset() {
        let f: Fault = "corrupt:1500".parse().unwrap();
        let st = FaultState { fault: Some(f) };
        assert_eq!(st.for_chunk(0, 0, 1000).corrupt_at, None);
        assert_eq!(st.for_chunk(1, 1000, 1000).corrupt_at, Some(500));
        let cut = FaultState {
            fault: Some("cut:0".parse().unwrap()),
        };
        assert_eq!(cut.for_chunk(0, 0, 10).cut_at, Some(0));
        let drop = FaultState {
            fault: Some("drop:2".parse().unwrap()),
        };
        assert!(!drop.for_chunk(1, 0, 1).drop && drop.for_chunk(2, 0, 1).drop);
        assert!("explode:1".parse::<Fault>().is_err());
        assert_eq!(
            "delay-ms:5".parse::<Fault>().unwrap(),
            Fault::DelayChunks {
                delay: Duration::from_millis(5)
            }
        );
    }
}
