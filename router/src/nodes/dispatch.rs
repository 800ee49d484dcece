//! [`Dispatch`]: one request counted on a node, as RAII. While it lives, the node's in-flight
//! count includes it and the work it brought is added to the node's last load report
//! ([`super::NodePool`]'s estimate); dropping it takes both back.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{NodeEntry, lock};
use crate::routing::LoadEstimate;

/// A request counted on a node; dropping it uncounts it.
#[derive(Debug)]
pub struct Dispatch {
    entry: Arc<NodeEntry>,
    ticket: u64,
    load: Option<LoadEstimate>,
    work: u64,
}

impl Dispatch {
    /// Records a dispatch of `work` (KV blocks to a decode node, uncached prompt tokens to a
    /// prefill node) until the node's next load report covers it; `load` is the node's
    /// estimate the choice was made on.
    pub(super) fn new(entry: Arc<NodeEntry>, work: u64, load: Option<LoadEstimate>) -> Self {
        let ticket = entry.next_ticket.fetch_add(1, Ordering::Relaxed);
        entry.in_flight.fetch_add(1, Ordering::SeqCst);
        lock(&entry.dispatches).push((ticket, Instant::now(), work));
        Self {
            entry,
            ticket,
            load,
            work,
        }
    }

    /// The node.
    pub fn node(&self) -> &Arc<NodeEntry> {
        &self.entry
    }

    /// The node's load when it was chosen (its fresh report plus this router's dispatches
    /// since), before this dispatch; `None` when the pool routed by in-flight counts or the
    /// node was named (canary).
    pub fn load(&self) -> Option<LoadEstimate> {
        self.load
    }

    /// The work this dispatch brought: KV blocks (decode), or the prompt tokens the node
    /// still has to compute, its cached prefix out (prefill).
    pub fn work(&self) -> u64 {
        self.work
    }
}

impl Drop for Dispatch {
    fn drop(&mut self) {
        self.entry.in_flight.fetch_sub(1, Ordering::SeqCst);
        lock(&self.entry.dispatches).retain(|(t, _, _)| *t != self.ticket);
    }
}
