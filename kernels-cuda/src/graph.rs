//! CUDA graphs: a run of kernels captured once from the device's stream and replayed with one
//! launch (~1 µs a kernel instead of ~6 µs launched one by one, on the H200 probe of
//! 2026-12-04). Decode steps of small models are launch-bound, so the engine captures each
//! decode shape once and replays it.
//!
//! # Invariants
//! - A graph replays the kernels with the arguments they were captured with: every buffer it
//!   reads or writes must stay allocated, at the same address, for the graph's lifetime, and
//!   the values that change between replays (token ids, positions, block tables) are copied
//!   into those buffers before each launch.
//! - Nothing may allocate, free or synchronize while capturing: callers allocate first. A
//!   failed capture ends the capture (the stream is usable again) and returns the error;
//!   nothing of it runs.
//! - [`CudaDevice::open`] turns cudarc's per-buffer event tracking off (it records events that
//!   a capture would take in): every buffer of this crate is used on its device's one stream.

use cudarc::driver::{CudaGraph, sys};

use crate::device::CudaDevice;
use crate::error::CudaError;

/// A captured, instantiated graph on one device's stream.
pub struct DeviceGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceGraph")
    }
}

// SAFETY: CUDA forbids touching one graph from two threads at once, not moving it between
// threads; `DeviceGraph` is not `Sync`, and `launch` takes it through its owner, so one thread
// at a time uses it (an engine moves to its own thread after it is built).
unsafe impl Send for DeviceGraph {}

impl DeviceGraph {
    /// Queues one replay on the stream it was captured from.
    pub fn launch(&self) -> Result<(), CudaError> {
        self.graph.launch().map_err(|e| CudaError::driver("cuGraphLaunch", e))
    }
}

impl CudaDevice {
    /// Captures what `enqueue` queues on the stream into a graph; nothing runs until
    /// [`DeviceGraph::launch`]. When `enqueue` fails, or the capture does, the capture is ended
    /// and the error returned.
    pub fn capture(&self, enqueue: impl FnOnce() -> Result<(), CudaError>) -> Result<DeviceGraph, CudaError> {
        let stream = self.stream();
        // Thread-local: another thread's unsafe call (a synchronous copy) does not break it.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| CudaError::driver("cuStreamBeginCapture", e))?;
        let queued = enqueue();
        // Always end the capture, so the stream takes ordinary work again.
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        queued?;
        match ended.map_err(|e| CudaError::driver("cuStreamEndCapture / cuGraphInstantiate", e))? {
            Some(graph) => Ok(DeviceGraph { graph }),
            None => Err(CudaError::Unsupported { op: "capture", what: "an empty graph (nothing was queued)".into() }),
        }
    }
}
