//! Framing of [`Msg`] on a byte stream: a length prefix and a checked rkyv body.
//!
//! Encoding reuses one aligned buffer per connection; decoding reads into one reused aligned
//! buffer and runs the *checked* `rkyv::access` before any field is used.

use rkyv::rancor;
use rkyv::util::AlignedVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::{ArchivedMsg, MAX_FRAME_BYTES, Msg};
use crate::error::TransferError;

/// Encodes `msg` as a frame (length prefix + rkyv body) into `buf`, replacing its contents.
pub fn encode_frame(msg: &Msg, buf: &mut AlignedVec) -> Result<(), TransferError> {
    let mut out = std::mem::take(buf);
    out.clear();
    out.extend_from_slice(&[0u8; 16]); // length prefix, padded to keep the body 16-aligned
    let mut out = rkyv::api::high::to_bytes_in::<_, rancor::Error>(msg, out)
        .map_err(|e| TransferError::protocol("encode", e.to_string()))?;
    let body = out.len() - 16;
    if body > MAX_FRAME_BYTES {
        return Err(TransferError::protocol(
            "frame_too_large",
            format!("{body} bytes"),
        ));
    }
    out.as_mut_slice()[12..16].copy_from_slice(&(body as u32).to_le_bytes());
    *buf = out;
    Ok(())
}

/// The bytes of an encoded frame to put on the wire (skips the alignment padding).
pub fn frame_bytes(buf: &AlignedVec) -> &[u8] {
    &buf.as_slice()[12..]
}

/// Writes one control frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &Msg,
    buf: &mut AlignedVec,
) -> Result<(), std::io::Error> {
    encode_frame(msg, buf)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
    w.write_all(frame_bytes(buf)).await
}

/// Reads frames from a stream into one reused, aligned buffer.
///
/// Cancel-safe: [`FrameReader::next`] keeps its progress in `self` and awaits only single
/// `read` calls, so it can sit in a `select!` beside other work. It never reads past the end of
/// the current frame, so a chunk's inline payload is still in the stream for
/// [`FrameReader::stream`] to read straight into the destination blocks.
pub struct FrameReader<R> {
    inner: R,
    buf: AlignedVec,
    header: [u8; 4],
    header_filled: usize,
    body_len: Option<usize>,
    body_filled: usize,
}

/// Why reading a frame failed.
#[derive(Debug)]
pub enum ReadError {
    /// The stream failed or ended.
    Io(std::io::Error),
    /// The bytes are not a valid frame.
    Invalid(TransferError),
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// Wraps a stream.
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            buf: AlignedVec::new(),
            header: [0; 4],
            header_filled: 0,
            body_len: None,
            body_filled: 0,
        }
    }

    /// Reads the next frame and checks it; the result borrows the reader's buffer.
    pub async fn next(&mut self) -> Result<&ArchivedMsg, ReadError> {
        let eof = || ReadError::Io(std::io::ErrorKind::UnexpectedEof.into());
        while self.header_filled < 4 {
            let n = self
                .inner
                .read(&mut self.header[self.header_filled..])
                .await
                .map_err(ReadError::Io)?;
            if n == 0 {
                return Err(eof());
            }
            self.header_filled += n;
        }
        let len = match self.body_len {
            Some(len) => len,
            None => {
                let len = u32::from_le_bytes(self.header) as usize;
                if len > MAX_FRAME_BYTES {
                    return Err(ReadError::Invalid(TransferError::protocol(
                        "frame_too_large",
                        format!("{len} bytes"),
                    )));
                }
                self.buf.clear();
                self.buf.resize(len, 0);
                self.body_len = Some(len);
                self.body_filled = 0;
                len
            }
        };
        while self.body_filled < len {
            let n = self
                .inner
                .read(&mut self.buf.as_mut_slice()[self.body_filled..len])
                .await
                .map_err(ReadError::Io)?;
            if n == 0 {
                return Err(eof());
            }
            self.body_filled += n;
        }
        self.header_filled = 0;
        self.body_len = None;
        rkyv::access::<ArchivedMsg, rancor::Error>(self.buf.as_slice()).map_err(|e| {
            ReadError::Invalid(TransferError::protocol("invalid_frame", e.to_string()))
        })
    }

    /// The underlying stream (for reading a chunk's inline payload right after its frame).
    pub fn stream(&mut self) -> &mut R {
        &mut self.inner
    }
}

/// Deserialises an archived message into its owned form (for cold-path messages).
pub fn to_owned<T, A>(archived: &A) -> Result<T, TransferError>
where
    A: rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    rkyv::deserialize::<T, rancor::Error>(archived)
        .map_err(|e| TransferError::protocol("decode", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Begin, Chunk, DataMode};

    fn begin() -> Msg {
        Msg::Begin(Begin {
            transfer_id: 7,
            request_id: u128::MAX - 3,
            trace_context: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
            reservation_id: 11,
            epoch: 2,
            layout_fingerprint: 0xfeed,
            src_blocks: vec![1, 2, 3],
            dst_blocks: vec![9, 8, 7],
            layer_start: 0,
            layer_end: 30,
            mode: DataMode::Rma,
        })
    }

    fn chunk() -> Msg {
        Msg::Chunk(Chunk {
            transfer_id: 7,
            seq: 1,
            layer_start: 2,
            layer_end: 4,
            payload_bytes: 4096,
            checksums: vec![1, 2, 3, 4],
        })
    }

    #[tokio::test]
    async fn frames_round_trip_through_a_stream_with_checked_access() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut buf = AlignedVec::new();
        let chunk = chunk();
        write_frame(&mut a, &begin(), &mut buf).await.unwrap();
        write_frame(&mut a, &chunk, &mut buf).await.unwrap();
        let mut r = FrameReader::new(b);
        let got: Msg = to_owned(r.next().await.unwrap()).unwrap();
        assert_eq!(got, begin());
        match r.next().await.unwrap() {
            ArchivedMsg::Chunk(c) => {
                assert_eq!(
                    c.checksums
                        .iter()
                        .map(|x| x.to_native())
                        .collect::<Vec<_>>(),
                    vec![1, 2, 3, 4]
                );
                assert_eq!(c.payload_bytes.to_native(), 4096);
            }
            _ => panic!("expected a chunk frame"),
        }
    }

    #[tokio::test]
    async fn garbage_and_oversized_frames_are_refused_by_checked_access() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        // A frame whose body is random bytes: checked access must refuse it.
        let body: Vec<u8> = (0..64u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        a.write_all(&(body.len() as u32).to_le_bytes())
            .await
            .unwrap();
        a.write_all(&body).await.unwrap();
        a.write_all(&((MAX_FRAME_BYTES + 1) as u32).to_le_bytes())
            .await
            .unwrap();
        let mut r = FrameReader::new(b);
        assert!(matches!(
            r.next().await,
            Err(ReadError::Invalid(TransferError::Protocol { .. }))
        ));
        assert!(matches!(
            r.next().await,
            Err(ReadError::Invalid(TransferError::Protocol {
                what: "frame_too_large",
                ..
            }))
        ));
    }

    #[tokio::test]
    async fn a_frame_read_cancelled_midway_resumes_where_it_stopped() {
        let (mut a, b) = tokio::io::duplex(1 << 16);
        let mut buf = AlignedVec::new();
        encode_frame(&begin(), &mut buf).unwrap();
        let bytes = frame_bytes(&buf).to_vec();
        let mut r = FrameReader::new(b);
        for cut in [2, bytes.len() / 2] {
            a.write_all(&bytes[..cut]).await.unwrap();
            // The read cannot finish; dropping it (as a losing select! branch does) loses nothing.
            let pending =
                tokio::time::timeout(std::time::Duration::from_millis(10), r.next()).await;
            assert!(pending.is_err());
            a.write_all(&bytes[cut..]).await.unwrap();
            let got: Msg = to_owned(r.next().await.unwrap()).unwrap();
            assert_eq!(got, begin());
        }
    }

    /// Fuzzed frames: valid Begin and Chunk frames with body bytes flipped, overwritten and
    /// truncated, and length prefixes changed, through the checked reader and the owned
    /// decode: no panic; each is either refused as a protocol error / end of stream, or decodes
    /// to a message (rkyv's validation allows some flips). `TANDEM_SEED` reproduces a run.
    #[tokio::test]
    async fn mutated_frames_are_refused_or_decoded_and_never_panic() {
        let seed: u64 = std::env::var("TANDEM_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1);
        let mut state = seed;
        let mut next = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let mut frames = Vec::new();
        for msg in [begin(), chunk()] {
            let mut buf = AlignedVec::new();
            encode_frame(&msg, &mut buf).unwrap();
            frames.push(frame_bytes(&buf).to_vec());
        }
        let (mut refused, mut decoded) = (0usize, 0usize);
        for case in 0..20_000 {
            let mut bytes = frames[(next() % 2) as usize].clone();
            for _ in 0..1 + next() % 3 {
                let at = (next() as usize) % bytes.len();
                match next() % 4 {
                    0 => bytes[at] ^= 1 << (next() % 8),
                    1 => bytes[at] = next() as u8,
                    2 => bytes.truncate(at.max(1)),
                    _ if bytes.len() >= 4 => {
                        // A different length prefix (shorter, longer, huge).
                        let len = [
                            0u32,
                            1,
                            3,
                            at as u32,
                            u32::MAX,
                            (MAX_FRAME_BYTES + 1) as u32,
                        ][(next() % 6) as usize];
                        bytes[..4].copy_from_slice(&len.to_le_bytes());
                    }
                    _ => {}
                }
            }
            let mut r = FrameReader::new(&bytes[..]);
            match r.next().await {
                Ok(archived) => match to_owned::<Msg, _>(archived) {
                    Ok(_) => decoded += 1,
                    Err(e) => {
                        assert!(
                            matches!(e, TransferError::Protocol { .. }),
                            "seed {seed}, case {case}: {e:?}"
                        );
                        refused += 1;
                    }
                },
                Err(ReadError::Invalid(TransferError::Protocol { .. })) | Err(ReadError::Io(_)) => {
                    refused += 1
                }
                Err(e) => panic!("seed {seed}, case {case}: {e:?}"),
            }
        }
        assert!(
            refused > 1000,
            "the mutations reach the checks: {refused} refused, {decoded} decoded"
        );
    }
}
