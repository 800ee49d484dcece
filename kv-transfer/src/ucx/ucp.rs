//! A small safe wrapper over the UCP calls this crate makes: context, worker, endpoint, memory
//! handle, remote key and request.
//!
//! Every type here is `!Send` (it holds raw UCX handles and `Rc`s) and lives on the one progress
//! thread of a [`super::worker::UcxRuntime`]; UCX's worker is created `UCS_THREAD_MODE_SINGLE`,
//! so this is what makes the calls sound. Ownership encodes UCX's destruction order: a
//! [`Worker`] keeps its [`Context`] alive, an [`Endpoint`] its worker, a [`MemHandle`] its
//! context, and an endpoint destroys its [`RemoteKey`] before it is closed.
//!
//! No other thread touches any of them: commands reach the progress thread over a channel.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_void};
use std::ptr;
use std::rc::Rc;

use tandem_ucx_sys as sys;

use crate::error::TransferError;

/// A `ucs_status_t` that is not `UCS_OK`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub sys::ucs_status_t);

impl Status {
    /// `ucs_status_string`.
    pub fn message(self) -> String {
        // SAFETY: ucs_status_string returns a pointer to a static, NUL-terminated string for any
        // status value (unknown ones included).
        unsafe { CStr::from_ptr(sys::ucs_status_string(self.0)) }
            .to_string_lossy()
            .into_owned()
    }

    /// The crate error for a failed call.
    pub fn error(self, op: &'static str) -> TransferError {
        TransferError::Ucx {
            op,
            status: self.0 as i32,
            message: self.message(),
        }
    }

    /// The peer reset or vanished (as opposed to a local failure).
    pub fn is_peer_failure(self) -> bool {
        matches!(
            self.0,
            sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_ENDPOINT_TIMEOUT
                | sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_REJECTED
                | sys::UCS_ERR_CANCELED
        ) || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_ENDPOINT_FAILURE)
            .contains(&self.0)
            || (sys::UCS_ERR_LAST_LINK_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE).contains(&self.0)
    }
}

fn check(status: sys::ucs_status_t) -> Result<(), Status> {
    if status == sys::UCS_OK {
        Ok(())
    } else {
        Err(Status(status))
    }
}

/// A UCP context with the RMA, TAG and WAKEUP features.
pub struct Context {
    h: sys::ucp_context_h,
}

impl Context {
    /// Reads UCX's configuration (the `UCX_*` environment), overrides `TLS` when `tls` is given
    /// (tandem's config wins over the environment), and initialises UCP with RMA and TAG.
    pub fn new(tls: Option<&str>) -> Result<Rc<Self>, TransferError> {
        let mut config: *mut sys::ucp_config_t = ptr::null_mut();
        // SAFETY: null prefix and file mean "defaults + environment"; `config` is a valid out-pointer.
        check(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) })
            .map_err(|s| s.error("ucp_config_read"))?;
        let result = (|| {
            if let Some(tls) = tls {
                let value = CString::new(tls)
                    .map_err(|_| TransferError::invalid("ucx_tls", "contains NUL"))?;
                // SAFETY: `config` came from ucp_config_read; both strings are NUL-terminated and
                // outlive the call.
                check(unsafe { sys::ucp_config_modify(config, c"TLS".as_ptr(), value.as_ptr()) })
                    .map_err(|s| s.error("ucp_config_modify(TLS)"))?;
            }
            let params = sys::ucp_params_t {
                field_mask: sys::UCP_PARAM_FIELD_FEATURES as u64,
                // No UCP_FEATURE_WAKEUP: with it, UCX 1.13 leaves shared-memory transports out of
                // the RMA lanes and emulates puts over active messages (two copies and the
                // receiver's CPU); the progress thread polls instead (see `worker`).
                features: (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_TAG) as u64,
                ..Default::default()
            };
            let mut h: sys::ucp_context_h = ptr::null_mut();
            // SAFETY: params is fully initialised (zeroed + the fields its mask names), config is
            // valid, `h` is a valid out-pointer.
            check(unsafe { sys::ucp_init(&params, config, &mut h) })
                .map_err(|s| s.error("ucp_init"))?;
            Ok(Rc::new(Self { h }))
        })();
        // SAFETY: `config` is released exactly once, after its last use.
        unsafe { sys::ucp_config_release(config) };
        result
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory handle holds an Rc to this context, so none is left.
        unsafe { sys::ucp_cleanup(self.h) };
    }
}

/// A UCP worker, driven by one thread.
pub struct Worker {
    h: sys::ucp_worker_h,
    _ctx: Rc<Context>,
}

impl Worker {
    /// Creates a single-threaded worker.
    pub fn new(ctx: &Rc<Context>) -> Result<Rc<Self>, TransferError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: ctx is a live context; params initialised as its mask says; `h` is an out-pointer.
        check(unsafe { sys::ucp_worker_create(ctx.h, &params, &mut h) })
            .map_err(|s| s.error("ucp_worker_create"))?;
        Ok(Rc::new(Self {
            h,
            _ctx: Rc::clone(ctx),
        }))
    }

    /// This worker's address, to hand to peers.
    pub fn address(&self) -> Result<Vec<u8>, TransferError> {
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live worker; out-pointers valid.
        check(unsafe { sys::ucp_worker_get_address(self.h, &mut addr, &mut len) })
            .map_err(|s| s.error("ucp_worker_get_address"))?;
        // SAFETY: UCX returned `len` readable bytes at `addr`, released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on this worker and is released once.
        unsafe { sys::ucp_worker_release_address(self.h, addr) };
        Ok(bytes)
    }

    /// Runs one round of progress; true if anything happened.
    pub fn progress(&self) -> bool {
        // SAFETY: called only from the worker's own thread (single-threaded mode).
        unsafe { sys::ucp_worker_progress(self.h) != 0 }
    }

    /// Cancels a pending request (it then completes with `UCS_ERR_CANCELED`).
    pub fn cancel(&self, req: &Request) {
        // SAFETY: `req` is a live, not yet freed request of this worker.
        unsafe { sys::ucp_request_cancel(self.h, req.ptr) };
    }

    /// Takes the next unexpected message matching `tag` under `mask` out of the worker and
    /// receives it into `sink` (grown to fit); `None` when there is none.
    pub fn drain_unexpected(
        &self,
        tag: u64,
        mask: u64,
        sink: &mut Vec<u8>,
    ) -> Option<Result<Started, TransferError>> {
        let mut info = sys::ucp_tag_recv_info_t::default();
        // SAFETY: own thread, live worker; `info` is a valid out-parameter; remove=1 hands the
        // message to us, and we receive it right below.
        let msg = unsafe { sys::ucp_tag_probe_nb(self.h, tag, mask, 1, &mut info) };
        if msg.is_null() {
            return None;
        }
        if sink.len() < info.length {
            sink.resize(info.length, 0);
        }
        let param = sys::ucp_request_param_t::default();
        // SAFETY: `sink` holds `info.length` bytes; the caller keeps it alive and unmoved until
        // the returned request completes.
        let p = unsafe {
            sys::ucp_tag_msg_recv_nbx(self.h, sink.as_mut_ptr().cast(), info.length, msg, &param)
        };
        Some(Started::from_ptr(p, "ucp_tag_msg_recv_nbx"))
    }

    /// Posts a tagged receive of exactly `len` bytes into `addr`.
    ///
    /// # Safety
    /// `addr..addr+len` stays valid and untouched by anyone else until the request completes.
    pub unsafe fn tag_recv(
        &self,
        addr: *mut u8,
        len: usize,
        tag: u64,
    ) -> Result<Started, TransferError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: buffer validity is the caller's contract; full tag mask (exact match).
        let p = unsafe { sys::ucp_tag_recv_nbx(self.h, addr.cast(), len, tag, u64::MAX, &param) };
        Started::from_ptr(p, "ucp_tag_recv_nbx")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // SAFETY: endpoints hold an Rc to this worker, so none is left; no other thread has it.
        unsafe { sys::ucp_worker_destroy(self.h) };
    }
}

/// An outstanding UCX request; freed on drop.
pub struct Request {
    ptr: *mut c_void,
}

impl Request {
    /// `None` while in progress; the outcome once complete.
    pub fn status(&self) -> Option<Result<(), Status>> {
        // SAFETY: `ptr` is a live request returned by an *_nbx call and not yet freed.
        match unsafe { sys::ucp_request_check_status(self.ptr) } {
            sys::UCS_INPROGRESS => None,
            s => Some(check(s)),
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: freed once. The worker only drops completed requests (or, at shutdown,
        // cancelled ones after they completed), so no buffer is written after this.
        unsafe { sys::ucp_request_free(self.ptr) };
    }
}

/// What an `*_nbx` call returned.
pub enum Started {
    /// Completed immediately.
    Done,
    /// In progress: poll it.
    Pending(Request),
}

impl Started {
    fn from_ptr(p: sys::ucs_status_ptr_t, op: &'static str) -> Result<Self, TransferError> {
        if p.is_null() {
            Ok(Started::Done)
        } else if sys::UCS_PTR_IS_ERR(p) {
            Err(Status(sys::UCS_PTR_STATUS(p)).error(op))
        } else {
            Ok(Started::Pending(Request { ptr: p }))
        }
    }
}

/// A registered memory region.
pub struct MemHandle {
    h: sys::ucp_mem_h,
    ctx: Rc<Context>,
}

impl MemHandle {
    /// Registers `len` bytes at `addr` (`ucp_mem_map` without allocation).
    ///
    /// # Safety
    /// The region stays allocated until this handle is dropped.
    pub unsafe fn map(ctx: &Rc<Context>, addr: *mut u8, len: usize) -> Result<Self, TransferError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: addr.cast(),
            length: len,
            ..Default::default()
        };
        let mut h: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: live context; the region's validity is the caller's contract.
        check(unsafe { sys::ucp_mem_map(ctx.h, &params, &mut h) })
            .map_err(|s| s.error("ucp_mem_map"))?;
        Ok(Self {
            h,
            ctx: Rc::clone(ctx),
        })
    }

    /// Lets UCX allocate `len` bytes where peers can reach them best (on one host: a
    /// shared-memory segment they map). Returns the handle and the region's address and length.
    pub fn allocate(
        ctx: &Rc<Context>,
        len: usize,
    ) -> Result<(Self, *mut u8, usize), TransferError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS)
                as u64,
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut h: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: live context; with ALLOCATE and no address UCX owns the region until unmap.
        check(unsafe { sys::ucp_mem_map(ctx.h, &params, &mut h) })
            .map_err(|s| s.error("ucp_mem_map(ALLOCATE)"))?;
        let memh = Self {
            h,
            ctx: Rc::clone(ctx),
        };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: live memh; `attr` is a valid out-parameter with its mask set.
        check(unsafe { sys::ucp_mem_query(memh.h, &mut attr) })
            .map_err(|s| s.error("ucp_mem_query"))?;
        Ok((memh, attr.address.cast(), attr.length))
    }

    /// The packed remote key peers need to write this region.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, TransferError> {
        let mut buf: *mut c_void = ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: live context and memh; out-pointers valid.
        check(unsafe { sys::ucp_rkey_pack(self.ctx.h, self.h, &mut buf, &mut len) })
            .map_err(|s| s.error("ucp_rkey_pack"))?;
        // SAFETY: UCX returned `len` readable bytes at `buf`; released right after the copy.
        let bytes = unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(bytes)
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: unmapped once, while its context is alive (held by `ctx`).
        let s = unsafe { sys::ucp_mem_unmap(self.ctx.h, self.h) };
        if s != sys::UCS_OK {
            tracing::warn!(status = Status(s).message(), "ucp_mem_unmap failed");
        }
    }
}

/// A remote key unpacked on an endpoint.
struct RemoteKey {
    h: sys::ucp_rkey_h,
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: destroyed once, before its endpoint is closed (Endpoint::close drops it first).
        unsafe { sys::ucp_rkey_destroy(self.h) };
    }
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the Box<Cell<_>> address an Endpoint registered; the Endpoint (and so the
    // box) outlives the ep handle, and UCX calls this on the worker's own thread.
    let cell = unsafe { &*(arg as *const Cell<sys::ucs_status_t>) };
    cell.set(status);
}

/// An endpoint to a peer's worker, with the peer pool's remote key.
pub struct Endpoint {
    h: sys::ucp_ep_h,
    rkey: Option<RemoteKey>,
    failed: Box<Cell<sys::ucs_status_t>>,
    closed: bool,
    _worker: Rc<Worker>,
}

impl Endpoint {
    /// Connects to a worker address. With `peer_failure`, UCX reports a dead peer by failing
    /// the endpoint's requests (UCX 1.13's shared-memory transports cannot, and refuse it).
    pub fn connect(
        worker: &Rc<Worker>,
        address: &[u8],
        peer_failure: bool,
    ) -> Result<Self, TransferError> {
        let failed = Box::new(Cell::new(sys::UCS_OK));
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
            address: address.as_ptr().cast(),
            err_mode: if peer_failure {
                sys::UCP_ERR_HANDLING_MODE_PEER
            } else {
                sys::UCP_ERR_HANDLING_MODE_NONE
            },
            err_handler: sys::ucp_err_handler {
                cb: Some(on_ep_error),
                arg: (&*failed as *const Cell<_>).cast_mut().cast(),
            },
            ..Default::default()
        };
        let mut h: sys::ucp_ep_h = ptr::null_mut();
        // SAFETY: live worker; `address` outlives the call (UCX copies what it needs); the error
        // callback's argument (the boxed cell) lives as long as the endpoint.
        check(unsafe { sys::ucp_ep_create(worker.h, &params, &mut h) })
            .map_err(|s| s.error("ucp_ep_create"))?;
        Ok(Self {
            h,
            rkey: None,
            failed,
            closed: false,
            _worker: Rc::clone(worker),
        })
    }

    /// Unpacks the peer's packed remote key onto this endpoint.
    pub fn unpack_rkey(&mut self, packed: &[u8]) -> Result<(), TransferError> {
        let mut h: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: live endpoint; `packed` is readable for the call; out-pointer valid.
        check(unsafe { sys::ucp_ep_rkey_unpack(self.h, packed.as_ptr().cast(), &mut h) })
            .map_err(|s| s.error("ucp_ep_rkey_unpack"))?;
        self.rkey = Some(RemoteKey { h });
        Ok(())
    }

    /// A local address for the peer's `remote` address when the transport maps the peer's
    /// memory into this process (shared memory); `None` otherwise (RDMA, tcp). Valid while the
    /// endpoint lives: closing it destroys the remote key, which unmaps.
    pub fn rkey_ptr(&self, remote: u64) -> Option<*mut u8> {
        let rkey = self.rkey.as_ref()?;
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: live rkey; `p` is a valid out-parameter.
        let s = unsafe { sys::ucp_rkey_ptr(rkey.h, remote, &mut p) };
        (s == sys::UCS_OK && !p.is_null()).then_some(p.cast())
    }

    /// The error the peer-failure handler recorded, if any.
    pub fn failure(&self) -> Option<Status> {
        let s = self.failed.get();
        (s != sys::UCS_OK).then_some(Status(s))
    }

    /// `ucp_ep_print_info` captured as text (which lanes and transports UCX chose).
    pub fn info(&self) -> String {
        let mut buf: *mut libc::c_char = ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: open_memstream writes the buffer pointer and size into our locals.
        let f = unsafe { libc::open_memstream(&mut buf, &mut len) };
        if f.is_null() {
            return String::new();
        }
        // SAFETY: live endpoint; `f` is a valid FILE* (libc's FILE is the same C type).
        unsafe { sys::ucp_ep_print_info(self.h, f.cast()) };
        // SAFETY: fclose flushes and finalises buf/len; buf is then ours to read and free.
        unsafe { libc::fclose(f) };
        // SAFETY: buf holds `len` bytes written by the stream (or is null on failure).
        let text = if buf.is_null() {
            String::new()
        } else {
            String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(buf as *const u8, len) })
                .into_owned()
        };
        // SAFETY: buf was malloc'ed by open_memstream; freed once.
        unsafe { libc::free(buf.cast()) };
        text
    }

    /// One-sided put of `len` bytes at `local` to `remote` in the peer pool.
    ///
    /// # Safety
    /// `local..local+len` stays valid and unchanged until the request completes, and
    /// `remote..remote+len` lies inside the region the unpacked key covers.
    pub unsafe fn put(
        &self,
        local: *const u8,
        len: usize,
        remote: u64,
    ) -> Result<Started, TransferError> {
        let rkey = self
            .rkey
            .as_ref()
            .ok_or_else(|| TransferError::protocol("ucx_put", "no remote key"))?;
        let param = sys::ucp_request_param_t::default();
        // SAFETY: buffer contract is the caller's; ep and rkey live.
        let p = unsafe { sys::ucp_put_nbx(self.h, local.cast(), len, remote, rkey.h, &param) };
        Started::from_ptr(p, "ucp_put_nbx")
    }

    /// Tagged send of `len` bytes at `addr`.
    ///
    /// # Safety
    /// `addr..addr+len` stays valid and unchanged until the request completes.
    pub unsafe fn tag_send(
        &self,
        addr: *const u8,
        len: usize,
        tag: u64,
    ) -> Result<Started, TransferError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: buffer contract is the caller's; live endpoint.
        let p = unsafe { sys::ucp_tag_send_nbx(self.h, addr.cast(), len, tag, &param) };
        Started::from_ptr(p, "ucp_tag_send_nbx")
    }

    /// Completes when every put issued on this endpoint is visible at the peer.
    pub fn flush(&self) -> Result<Started, TransferError> {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint; the param needs no buffers.
        Started::from_ptr(
            unsafe { sys::ucp_ep_flush_nbx(self.h, &param) },
            "ucp_ep_flush_nbx",
        )
    }

    /// Closes the endpoint (forcibly when the peer failed or `force`): the remote key first.
    pub fn close(mut self, force: bool) -> Result<Started, TransferError> {
        self.rkey = None;
        let force = force || self.failure().is_some();
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force {
                sys::UCP_EP_CLOSE_FLAG_FORCE
            } else {
                0
            },
            ..Default::default()
        };
        // SAFETY: live endpoint closed once (`closed` stops Drop from closing it again); its
        // rkey was destroyed just above.
        let p = unsafe { sys::ucp_ep_close_nbx(self.h, &param) };
        self.closed = true;
        Started::from_ptr(p, "ucp_ep_close_nbx")
    }
}

thread_local! {
    /// The boxes are the point: each error callback holds the address of its cell, which must
    /// not move when the list grows.
    #[allow(clippy::vec_box)]
    /// Error cells of closed endpoints: UCX may call an endpoint's error handler until its close
    /// completes, so they are kept until the progress thread exits (a few bytes per endpoint).
    static CLOSED_EP_CELLS: std::cell::RefCell<Vec<Box<Cell<sys::ucs_status_t>>>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.rkey = None;
        if !self.closed {
            // Dropped without close() (an error path): force-close, do not wait.
            let param = sys::ucp_request_param_t {
                op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                ..Default::default()
            };
            // SAFETY: live endpoint, closed once; a returned request is freed at once (UCX then
            // releases it on completion).
            let p = unsafe { sys::ucp_ep_close_nbx(self.h, &param) };
            if sys::UCS_PTR_IS_PTR(p) {
                drop(Request { ptr: p });
            }
        }
        // UCX may still call the error handler while the close completes: keep its cell.
        let cell = std::mem::replace(&mut self.failed, Box::new(Cell::new(sys::UCS_OK)));
        CLOSED_EP_CELLS.with(|c| c.borrow_mut().push(cell));
    }
}
